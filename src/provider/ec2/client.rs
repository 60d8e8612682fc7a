//! The AWS SDK client: region and credentials from settings or the standard
//! AWS chain, an optional `endpoint_url` (emulators), bounded timeouts, and the
//! SDK's own retries turned off on purpose — throttling and capacity waits are
//! dormant's, visible in the job log (`call.rs`, `capacity.rs`).

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{bail, Result};
use aws_config::retry::RetryConfig;
use aws_config::timeout::TimeoutConfig;
use aws_config::{BehaviorVersion, SdkConfig};
use aws_sdk_ec2::config::{Credentials, Region};
use aws_sdk_ec2::Client;
use tokio::sync::{Mutex, OnceCell};

use crate::settings::ec2::Ec2Settings;

/// Connecting to the EC2 endpoint: a healthy endpoint answers in milliseconds.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// One API call attempt; EC2's slowest calls (RunInstances) take a few seconds.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(30);

/// Clients per region, built lazily: constructing the provider makes no call
/// and reads no credentials (config and `list` of other providers stay fast).
pub struct Clients {
    region: Option<String>,
    endpoint_url: Option<String>,
    credentials: Option<Credentials>,
    base: OnceCell<SdkConfig>,
    by_region: Mutex<HashMap<String, Client>>,
}

impl Clients {
    pub fn new(settings: &Ec2Settings, credentials: Option<Credentials>) -> Self {
        Clients {
            region: settings.region.clone(),
            endpoint_url: settings.endpoint_url.clone(),
            credentials,
            base: OnceCell::new(),
            by_region: Mutex::new(HashMap::new()),
        }
    }

    async fn base(&self) -> &SdkConfig {
        self.base
            .get_or_init(|| async {
                let mut loader = aws_config::defaults(BehaviorVersion::latest())
                    // Deliberate: one attempt per SDK call. dormant retries
                    // throttling and transient faults itself, with backoff bounded by
                    // the prepare timeout and a line in the job log for each wait.
                    .retry_config(RetryConfig::disabled())
                    .timeout_config(
                        TimeoutConfig::builder()
                            .connect_timeout(CONNECT_TIMEOUT)
                            .operation_attempt_timeout(ATTEMPT_TIMEOUT)
                            .build(),
                    );
                if let Some(r) = &self.region {
                    loader = loader.region(Region::new(r.clone()));
                }
                if let Some(e) = &self.endpoint_url {
                    loader = loader.endpoint_url(e);
                }
                if let Some(c) = &self.credentials {
                    loader = loader.credentials_provider(c.clone());
                }
                loader.load().await
            })
            .await
    }

    /// The region instances are made in: `ec2.region`, else the AWS chain's.
    pub async fn default_region(&self) -> Result<String> {
        match self.base().await.region() {
            Some(r) => Ok(r.to_string()),
            None => bail!(
                "no AWS region: set ec2.region in dormant's settings (or AWS_REGION in the runner's environment)"
            ),
        }
    }

    /// A client for `region` (an environment keeps the region it was made in).
    pub async fn client(&self, region: &str) -> Client {
        let mut map = self.by_region.lock().await;
        if let Some(c) = map.get(region) {
            return c.clone();
        }
        let conf = aws_sdk_ec2::config::Builder::from(self.base().await)
            .region(Region::new(region.to_string()))
            .build();
        let client = Client::from_conf(conf);
        map.insert(region.to_string(), client.clone());
        client
    }
}
