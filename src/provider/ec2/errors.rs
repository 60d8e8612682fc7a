//! What an EC2 error means for dormant: wait it out (throttling, capacity, a
//! transient fault), treat it as "not visible yet" (eventual consistency right
//! after a launch), or fail with one line naming the setting or IAM permission
//! at fault.

use std::fmt;

use aws_sdk_ec2::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_smithy_runtime_api::client::orchestrator::HttpResponse;

/// How dormant reacts to an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// API rate limit: retried with backoff inside the call.
    Throttled,
    /// No capacity / over a quota: waited out by the capacity loop (launch and start).
    Capacity,
    /// 5xx, a timeout, a dropped connection: retried a few times.
    Transient,
    /// The instance is not (or no longer, or not yet) visible.
    NotFound,
    /// Anything else: a system failure with a hint.
    Fatal,
}

/// One failed EC2 API call, classified, with a hint for the job log.
#[derive(Debug)]
pub struct ApiError {
    pub action: &'static str,
    pub kind: ErrorKind,
    pub code: Option<String>,
    pub message: String,
    pub hint: Option<String>,
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "EC2 {} failed", self.action)?;
        match &self.code {
            Some(code) => write!(f, ": {code}: {}", self.message)?,
            None => write!(f, ": {}", self.message)?,
        }
        if let Some(hint) = &self.hint {
            write!(f, " — {hint}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ApiError {}

const THROTTLE_CODES: &[&str] = &[
    "RequestLimitExceeded",
    "Throttling",
    "ThrottlingException",
    "RequestThrottled",
    "SlowDown",
];

/// Errors that go away when capacity frees up (or a quota is raised).
const CAPACITY_CODES: &[&str] = &[
    "InsufficientInstanceCapacity",
    "InsufficientCapacity",
    "InsufficientHostCapacity",
    "InsufficientReservedInstanceCapacity",
    "InstanceLimitExceeded",
    "VcpuLimitExceeded",
    "MaxSpotInstanceCountExceeded",
    "SpotMaxPriceTooLow",
    "Unsupported",
];

/// The instance or volume is not (or no longer, or not yet) visible.
const NOT_FOUND_CODES: &[&str] = &["InvalidInstanceID.NotFound", "InvalidVolume.NotFound"];

const CREDENTIAL_CODES: &[&str] = &[
    "AuthFailure",
    "InvalidClientTokenId",
    "SignatureDoesNotMatch",
    "UnrecognizedClientException",
    "ExpiredToken",
    "RequestExpired",
    "IncompleteSignature",
    "MissingAuthenticationToken",
];

/// How dormant finds credentials: the standard AWS chain.
pub const CREDENTIALS_HELP: &str = "dormant uses the standard AWS credential chain: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY \
     (and AWS_SESSION_TOKEN) in the runner's environment, AWS_PROFILE and ~/.aws/credentials of the user \
     gitlab-runner runs as, web identity, or the instance profile of the runner host";

impl ApiError {
    pub fn classify<E>(action: &'static str, err: &SdkError<E, HttpResponse>) -> ApiError
    where
        E: ProvideErrorMetadata + std::error::Error + 'static,
    {
        let code = err.code().map(str::to_string);
        let status = err.raw_response().map(|r| r.status().as_u16());
        let message = err
            .message()
            .map(str::to_string)
            .unwrap_or_else(|| without_debug_dump(&format!("{}", DisplayErrorContext(err))));
        let no_credentials = code.is_none() && message.to_ascii_lowercase().contains("credential");
        let kind = match (&code, err) {
            // Missing credentials surface as a dispatch failure: not transient.
            _ if no_credentials => ErrorKind::Fatal,
            (Some(c), _) if THROTTLE_CODES.contains(&c.as_str()) => ErrorKind::Throttled,
            (Some(c), _) if CAPACITY_CODES.contains(&c.as_str()) => ErrorKind::Capacity,
            (Some(c), _) if NOT_FOUND_CODES.contains(&c.as_str()) => ErrorKind::NotFound,
            (
                _,
                SdkError::TimeoutError(_)
                | SdkError::DispatchFailure(_)
                | SdkError::ResponseError(_),
            ) => ErrorKind::Transient,
            _ if status.is_some_and(|s| s >= 500) => ErrorKind::Transient,
            _ => ErrorKind::Fatal,
        };
        let hint = hint(action, code.as_deref(), &message, err);
        ApiError {
            action,
            kind,
            code,
            message,
            hint,
        }
    }
}

/// `DisplayErrorContext` ends with the error's `Debug` form in parentheses:
/// one line for the job log is enough.
fn without_debug_dump(text: &str) -> String {
    let cut = [
        " (DispatchFailure(",
        " (TimeoutError(",
        " (ConstructionFailure(",
        " (ResponseError(",
        " (ServiceError(",
    ]
    .iter()
    .filter_map(|p| text.find(p))
    .min()
    .unwrap_or(text.len());
    text[..cut].to_string()
}

/// The IAM action behind an API call.
fn permission(action: &str) -> String {
    format!("ec2:{action}")
}

fn hint<E>(
    action: &'static str,
    code: Option<&str>,
    message: &str,
    err: &SdkError<E, HttpResponse>,
) -> Option<String>
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    let lower = message.to_ascii_lowercase();
    let code = match code {
        Some(c) => c,
        None => {
            let text = format!("{}", DisplayErrorContext(err)).to_ascii_lowercase();
            return match err {
                _ if text.contains("credential") => {
                    Some(format!("no usable AWS credentials were found: {CREDENTIALS_HELP}"))
                }
                SdkError::DispatchFailure(_) => Some(
                    "cannot reach the EC2 endpoint: check ec2.region / ec2.endpoint_url and the runner host's network"
                        .into(),
                ),
                _ => None,
            };
        }
    };
    let h = match code {
        "UnauthorizedOperation" | "AccessDenied" | "AccessDeniedException" => {
            let mut h = format!(
                "the AWS identity dormant runs as lacks the IAM permission {} (see the minimal IAM policy in docs/ec2.md)",
                permission(action)
            );
            if action == "RunInstances" {
                h.push_str(
                    "; a launch also needs ec2:CreateTags (tags are set at launch) and, with ec2.iam_instance_profile, \
                     iam:PassRole on its role",
                );
            }
            h
        }
        c if CREDENTIAL_CODES.contains(&c) => {
            format!("AWS rejected the credentials: {CREDENTIALS_HELP}")
        }
        c if c.starts_with("InvalidAMIID") => {
            "the image does not exist in this region or is not visible to this account: check ec2.image \
             (or the job's image: and ec2.allowed_images) and ec2.image_owners"
                .into()
        }
        c if c.starts_with("InvalidSubnet") => {
            "check ec2.subnet_id / ec2.subnet_ids (the subnets must exist in ec2.region)".into()
        }
        c if c.starts_with("InvalidGroup") || c.starts_with("InvalidSecurityGroup") => {
            "check ec2.security_group_ids (the groups must be in the subnet's VPC)".into()
        }
        "InvalidInstanceType" => "check ec2.instance_type / ec2.allowed_instance_types".into(),
        "UnsupportedHibernationConfiguration" => {
            "hibernation is not supported for this image or instance type: check ec2.suspend_mode".into()
        }
        "IdempotentParameterMismatch" => {
            "an earlier attempt of this prepare launched with other parameters (settings changed in between?); \
             `dormant sweep` lists its instance"
                .into()
        }
        "OptInRequired" => "the AWS account is not subscribed to this service or AMI (marketplace)".into(),
        "InvalidParameterValue" | "InvalidParameterCombination" | "InvalidParameter" => {
            if lower.contains("instance type") || lower.contains("instancetype") {
                "check ec2.instance_type / ec2.allowed_instance_types".into()
            } else if lower.contains("iaminstanceprofile") || lower.contains("instance profile") {
                "check ec2.iam_instance_profile".into()
            } else if action == "CreateVolume" {
                "check ec2.data_volume_* settings".into()
            } else if lower.contains("volume") || lower.contains("blockdevice") || lower.contains("kms") {
                "check ec2.root_volume_* settings".into()
            } else if lower.contains("subnet") {
                "check ec2.subnet_id / ec2.subnet_ids".into()
            } else if lower.contains("spot") || lower.contains("market") {
                "check ec2.market (spot is not offered for every instance type and image)".into()
            } else if lower.contains("hibernat") {
                "check ec2.suspend_mode and the root volume settings".into()
            } else {
                return None;
            }
        }
        "InvalidVolume.NotFound" if action.contains("Volume") => return None,
        "InvalidBlockDeviceMapping" | "InvalidVolume.NotFound" => "check ec2.root_volume_* settings".into(),
        "InvalidKMSKey.InvalidState" | "KMS.NotFoundException" | "InvalidKMSKey.NotFound"
            if action == "CreateVolume" =>
        {
            "check ec2.data_volume_kms_key_id".into()
        }
        "InvalidKMSKey.InvalidState" | "KMS.NotFoundException" => "check ec2.root_volume_kms_key_id".into(),
        "InvalidVolume.ZoneMismatch" => {
            "a volume can only be attached to an instance in its own zone: the environment's volume must \
             resume in the subnet of its zone (ec2.subnet_ids)"
                .into()
        }
        "VolumeLimitExceeded" => {
            "the account's EBS storage quota for this volume type is reached: release suspended environments \
             (`dormant list`) or raise the quota"
                .into()
        }
        "IncorrectInstanceState" => return None,
        c if CAPACITY_CODES.contains(&c) => {
            "EC2 has no capacity for this instance type in the subnet's zone (and market), or an account quota \
             is reached: add ec2.fallback_instance_types or zones (ec2.subnet_ids), or raise the quota"
                .into()
        }
        c if THROTTLE_CODES.contains(&c) => {
            "the account's EC2 API rate limit: other tools in this account call EC2 a lot".into()
        }
        _ => return None,
    };
    Some(h)
}

/// The classified API error inside an `anyhow` chain, if there is one.
pub fn api_error(err: &anyhow::Error) -> Option<&ApiError> {
    err.downcast_ref::<ApiError>()
}

/// The capacity error as a line for the job log; any other error is passed on.
pub fn capacity_reason(e: anyhow::Error) -> anyhow::Result<String> {
    match api_error(&e) {
        Some(a) if a.kind == ErrorKind::Capacity => Ok(format!(
            "EC2 {}: {}",
            a.code.as_deref().unwrap_or("capacity"),
            a.message
        )),
        _ => Err(e),
    }
}

pub fn is_not_found(err: &anyhow::Error) -> bool {
    api_error(err).is_some_and(|e| e.kind == ErrorKind::NotFound)
}

#[cfg(test)]
mod tests {
    use super::*;
    use aws_sdk_ec2::error::ErrorMetadata;
    use aws_sdk_ec2::operation::run_instances::RunInstancesError;
    use aws_smithy_runtime_api::http::StatusCode;
    use aws_smithy_types::body::SdkBody;

    fn service_error(code: &str, status: u16) -> SdkError<RunInstancesError, HttpResponse> {
        let meta = ErrorMetadata::builder()
            .code(code)
            .message("aws says no")
            .build();
        let raw = HttpResponse::new(StatusCode::try_from(status).unwrap(), SdkBody::empty());
        SdkError::service_error(RunInstancesError::generic(meta), raw)
    }

    #[test]
    fn classifies_codes() {
        let k = |c, s| ApiError::classify("RunInstances", &service_error(c, s)).kind;
        assert_eq!(k("RequestLimitExceeded", 503), ErrorKind::Throttled);
        assert_eq!(k("InsufficientInstanceCapacity", 500), ErrorKind::Capacity);
        assert_eq!(k("InstanceLimitExceeded", 400), ErrorKind::Capacity);
        assert_eq!(k("InvalidInstanceID.NotFound", 400), ErrorKind::NotFound);
        assert_eq!(k("InternalError", 500), ErrorKind::Transient);
        assert_eq!(k("InvalidAMIID.NotFound", 400), ErrorKind::Fatal);
    }

    #[test]
    fn hints_name_the_setting_or_permission() {
        let t = |c| ApiError::classify("RunInstances", &service_error(c, 400)).to_string();
        assert!(
            t("UnauthorizedOperation").contains("ec2:RunInstances"),
            "{}",
            t("UnauthorizedOperation")
        );
        assert!(t("InvalidAMIID.NotFound").contains("ec2.image"));
        assert!(t("InvalidSubnetID.NotFound").contains("ec2.subnet_id"));
        assert!(t("InvalidGroup.NotFound").contains("ec2.security_group_ids"));
        assert!(t("AuthFailure").contains("credential chain"));
    }
}
