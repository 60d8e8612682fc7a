use super::*;
use crate::context::JobLog;
use crate::provider::qemu::process::fake::FakeQemu;
use crate::state::EnvPaths;

#[tokio::test]
async fn quit_ends_both_processes_of_a_qemu_caught_daemonizing() {
    let dir = tempfile::tempdir().unwrap();
    let vm = VmDir::new(&EnvPaths::new(dir.path(), uuid::Uuid::new_v4()));
    vm.ensure().unwrap();
    // The parent exits 3 s in: after the looks below however loaded the
    // machine, long before quit's wait for it (10 s) runs out.
    let mut parent = FakeQemu::start_daemonizing(dir.path(), &vm, "3");
    let environments = dir.path().join("environments");
    let both = process::scan(&environments);
    assert_eq!(both.len(), 2, "parent and child run: {both:?}");
    let parent_pid = process::Pid(parent.0.id() as i32);
    assert_eq!(
        process::find(&vm),
        Some(parent_pid),
        "the parent is found first"
    );

    let ctx = Ctx::new(
        JobLog::capture().0,
        Default::default(),
        Duration::from_secs(60),
    );
    quit(&vm, &ctx).await.unwrap();
    let left = process::scan(&environments);
    assert!(
        left.is_empty(),
        "the daemonized child outlived quit: {left:?}"
    );
    parent.0.wait().unwrap();
}
