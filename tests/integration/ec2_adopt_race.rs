//! Two hosts adopting the same environment at once (moto behind the test
//! proxy). Each take-over writes the next epoch with its own owner id
//! (`<n>/<owner>`) and reads the tag back. The steps of two take-overs are
//! interleaved by hand, both having checked the instance before either
//! wrote (so the check before the write cannot tell them apart):
//! - the second write lands before the first host reads back: the first
//!   sees the other owner and gives up, the second keeps it;
//! - the second write lands after the first host read back (the window that
//!   remains, docs/ec2.md): both believe they won, but the tag holds one
//!   owner's value, and only a record with that value passes the epoch
//!   check every start, stop and terminate makes.

use std::time::Duration;

use dormant::context::{Ctx, JobLog};
use dormant::provider::ec2::handover::{epoch_matches, epoch_value, new_owner_id};
use dormant::provider::ec2::takeover::Adoptable;
use dormant::provider::ec2::takeover_write::Confirmed;
use dormant::provider::ec2::Ec2Provider;
use dormant::settings::Settings;
use dormant::state::StateStore;
use tokio_util::sync::CancellationToken;

use crate::ec2_adopt::{suspend_one, SYSTEM};
use crate::ec2_rig::{block_on, instance_tags, key_field, Ec2Env};
use crate::moto::{ACCESS_KEY, SECRET_KEY};

/// Any ed25519 public key line: what the boot hook's tag takes.
const KEY: &str =
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIK0wmN/Cr3JXqmLW7u+g9pTh+wyqDHpSQEIQczXkVx9q race";

/// A host: its own state dir, the same settings and system id.
fn host(env: &Ec2Env, dir: &std::path::Path) -> Ec2Provider {
    let text = format!(
        "system_id = \"{SYSTEM}\"\nrunner_system_id_file = \"/nonexistent\"\n{}",
        env.settings(&env.connect_address(), "")
    );
    let settings = Settings::parse_str(&text).unwrap_or_else(|e| panic!("{e:#}\n{text}"));
    let store = StateStore::open(dir).unwrap();
    Ec2Provider::with_credentials(&settings, &store, ACCESS_KEY, SECRET_KEY).unwrap()
}

async fn the_one(p: &Ec2Provider, ctx: &Ctx) -> Adoptable {
    let mut found = p.takeover_candidates(None, ctx).await.unwrap();
    assert_eq!(found.adoptable.len(), 1, "{:?}", found.left);
    found.adoptable.remove(0)
}

#[test]
fn two_adopters_racing_leave_one_owner() {
    let env = Ec2Env::start();
    let key = suspend_one(&env.rig("7", SYSTEM, &env.settings(&env.connect_address(), "")));
    let id = key_field(&key, "instance").unwrap();
    let dirs = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (a, b) = (host(&env, dirs.0.path()), host(&env, dirs.1.path()));
    let ctx = Ctx::new(
        JobLog::capture().0,
        CancellationToken::new(),
        Duration::from_secs(120),
    );
    let epoch_tag = || instance_tags(&env, &id).get("dormant:epoch").cloned();

    // 1. Both check, both write, then each reads back: the later write wins,
    //    the earlier writer sees it and gives up.
    let (va, vb) = block_on(async {
        let (fa, fb) = (the_one(&a, &ctx).await, the_one(&b, &ctx).await);
        assert_eq!((fa.epoch, fb.epoch), (1, 1));
        let (va, vb) = (
            epoch_value(fa.epoch + 1, &new_owner_id()),
            epoch_value(fb.epoch + 1, &new_owner_id()),
        );
        a.check_as_found(&fa, Some(KEY), &ctx).await.unwrap();
        b.check_as_found(&fb, Some(KEY), &ctx).await.unwrap();
        a.write_epoch(&fa, &va, Some(KEY), &ctx).await.unwrap();
        b.write_epoch(&fb, &vb, Some(KEY), &ctx).await.unwrap();
        let t = fa.what.taken();
        let found = fa.epoch_tag.as_deref();
        assert_eq!(
            a.confirm(t, found, &va, &ctx).await.unwrap(),
            Confirmed::Another(Some(vb.clone())),
            "the first writer sees the other owner"
        );
        assert_eq!(
            b.confirm(t, found, &vb, &ctx).await.unwrap(),
            Confirmed::Ours
        );
        // A take-over checked after both writes sees the change: refused.
        let err = a.check_as_found(&fa, Some(KEY), &ctx).await.unwrap_err();
        assert!(
            format!("{err:#}").contains("changed while it was being adopted"),
            "{err:#}"
        );
        (va, vb)
    });
    assert_eq!(epoch_tag(), Some(vb.clone()));
    assert!(epoch_matches(Some(&vb), epoch_tag().as_deref()));
    assert!(!epoch_matches(Some(&va), epoch_tag().as_deref()));

    // 2. The window: the other write lands after this host read back. Both
    //    see their own value, but only the last one's record may act.
    let (va, vb) = block_on(async {
        let (fa, fb) = (the_one(&a, &ctx).await, the_one(&b, &ctx).await);
        assert_eq!((fa.epoch, fb.epoch), (2, 2));
        let (va, vb) = (
            epoch_value(fa.epoch + 1, &new_owner_id()),
            epoch_value(fb.epoch + 1, &new_owner_id()),
        );
        a.check_as_found(&fa, Some(KEY), &ctx).await.unwrap();
        b.check_as_found(&fb, Some(KEY), &ctx).await.unwrap();
        let (t, found) = (fa.what.taken(), fa.epoch_tag.clone());
        a.write_epoch(&fa, &va, Some(KEY), &ctx).await.unwrap();
        assert_eq!(
            a.confirm(t, found.as_deref(), &va, &ctx).await.unwrap(),
            Confirmed::Ours
        );
        b.write_epoch(&fb, &vb, Some(KEY), &ctx).await.unwrap();
        assert_eq!(
            b.confirm(t, found.as_deref(), &vb, &ctx).await.unwrap(),
            Confirmed::Ours
        );
        (va, vb)
    });
    assert!(va.starts_with("3/") && vb.starts_with("3/") && va != vb);
    let now = epoch_tag();
    assert!(
        epoch_matches(Some(&vb), now.as_deref()) && !epoch_matches(Some(&va), now.as_deref()),
        "the same number, one owner: {now:?}"
    );
}
