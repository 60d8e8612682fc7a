//! The warm VMs' provider side without a guest: slots, the kind, the
//! hand-over with a stand-in QEMU (`process::fake`).

use super::*;
use crate::provider::qemu::process::fake::FakeQemu;
use crate::provider::qemu::vm::Launch;
use crate::settings::Settings;
use crate::state::pool::Pool;
use crate::state::StateStore;

fn provider(dir: &std::path::Path) -> (StateStore, QemuProvider) {
    let store = StateStore::open(&dir.join("state")).unwrap();
    let mut settings = Settings::default();
    let disk = dir.join("base.qcow2");
    std::fs::write(&disk, b"an image").unwrap();
    settings.qemu.image = Some(BootImage::Path(disk));
    settings.qemu.warm = 1;
    (store.clone(), QemuProvider::new(&settings, &store))
}

#[tokio::test]
async fn a_refill_never_takes_the_last_slot_of_max_environments() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = provider(dir.path());
    let with_max = |max: u32| {
        let mut settings = Settings::default();
        settings.qemu.image = Some(BootImage::Path(dir.path().join("base.qcow2")));
        settings.qemu.warm = 1;
        settings.qemu.max_environments = max;
        QemuProvider::new(&settings, &store)
    };
    let ctx = Ctx::new(
        crate::context::JobLog::stderr(),
        Default::default(),
        Duration::from_secs(30),
    );
    let p = with_max(3);
    assert_eq!(p.no_room(&ctx).await.unwrap(), None, "nothing runs");
    // A job's VM: two of three slots free, a warm VM may boot.
    let job = VmDir::new(&store.env_paths(uuid::Uuid::new_v4()));
    let _job = FakeQemu::start(dir.path(), &job);
    assert_eq!(p.no_room(&ctx).await.unwrap(), None, "one of three runs");
    // And a warm VM: the last slot stays free for a job.
    let pool = Pool::new(&store);
    let (wp, _entry, _lock) = pool.begin_launch("qemu", "fp", "default", None).unwrap();
    let _warm = FakeQemu::start(dir.path(), &p.warm_vm(&wp));
    let why = p
        .no_room(&ctx)
        .await
        .unwrap()
        .expect("no room for a third VM");
    assert!(
        why.contains("2 of qemu.max_environments = 3 VMs run"),
        "{why}"
    );
    // Room enough with a higher limit, and no limit at all.
    assert_eq!(with_max(4).no_room(&ctx).await.unwrap(), None);
    assert_eq!(with_max(0).no_room(&ctx).await.unwrap(), None);
    // A job's own VM: waits only once every slot is taken.
    assert!(!p.job_must_wait(&ctx).await.unwrap(), "two of three run");
    assert!(
        with_max(2).job_must_wait(&ctx).await.unwrap(),
        "two of two run"
    );
    assert!(!with_max(0).job_must_wait(&ctx).await.unwrap(), "no limit");
}

#[tokio::test]
async fn a_handed_over_vm_is_the_environments_and_its_qemu_is_still_found() {
    let dir = tempfile::tempdir().unwrap();
    let (store, p) = provider(dir.path());
    let pool = Pool::new(&store);
    let (wp, _entry, _lock) = pool.begin_launch("qemu", "fp", "default", None).unwrap();
    let from = p.warm_vm(&wp);
    from.ensure().unwrap();
    let qemu = FakeQemu::start(dir.path(), &from);
    std::fs::write(from.pidfile(), qemu.0.id().to_string()).unwrap();
    let argv = vec![
        "qemu".to_string(),
        "-name".into(),
        from.name(),
        "-drive".into(),
        format!("file={}/overlay.qcow2", from.dir.display()),
        "-pidfile".into(),
        from.pidfile().display().to_string(),
    ];
    from.write_launch(&Launch {
        version: 2,
        argv,
        port: 2222,
        running_as: None,
    })
    .unwrap();
    assert_eq!(super::super::capacity::running(store.root()), 1);

    let env = store.env_paths(uuid::Uuid::new_v4());
    std::fs::create_dir_all(&env.dir).unwrap();
    let ctx = Ctx::new(
        crate::context::JobLog::stderr(),
        Default::default(),
        Duration::from_secs(30),
    );
    assert!(!p.handed_over(&wp, &env, &ctx).await.unwrap());
    // The environment's record, as its prepare made it (no machine yet).
    crate::state::testing::place(
        &store,
        env.id,
        crate::state::EnvStatus::Creating,
        None,
        0,
        None,
    )
    .unwrap();
    use crate::provider::Provider;
    assert_eq!(p.find(env.id, &ctx).await.unwrap(), None, "no VM yet");
    let warm_machine = p.machine(wp.id, 2222, "default");
    let m = p.hand_over(&wp, &warm_machine, &env, &ctx).await.unwrap();
    // What a retried prepare asks before taking a warm VM (the killed
    // attempt never recorded this one): found, so none is taken and
    // create adopts this running QEMU (`process::find`, below).
    assert_eq!(
        p.find(env.id, &ctx).await.unwrap().map(|f| f.id),
        Some(m.id.clone()),
        "a retried prepare finds the handed-over VM"
    );
    assert_eq!(m.field(field::ENV), Some(env.id.to_string().as_str()));
    assert_eq!(m.field(field::PORT), Some("2222"));
    assert!(p.handed_over(&wp, &env, &ctx).await.unwrap());
    // Retried (a killed hand-over): the same answer, nothing moved twice.
    let again = p.hand_over(&wp, &warm_machine, &env, &ctx).await.unwrap();
    assert_eq!(again, m);

    let to = VmDir::new(&env);
    assert_eq!(
        process::find(&to).map(|pid| pid.0 as u32),
        Some(qemu.0.id()),
        "the running QEMU is found as the environment's"
    );
    assert_eq!(
        super::super::capacity::running(store.root()),
        1,
        "counted once"
    );
    let launch = to.read_launch().unwrap().unwrap();
    let joined = launch.argv.join(" ");
    assert!(
        joined.contains(&to.name()) && !joined.contains(&from.name()),
        "{joined}"
    );
    assert!(joined.contains(&to.dir.display().to_string()), "{joined}");
    assert!(
        !joined.contains(&from.dir.display().to_string()),
        "{joined}"
    );

    // A QEMU started under another name is not taken for it.
    let other = VmDir::new(&store.env_paths(uuid::Uuid::new_v4()));
    other.ensure().unwrap();
    std::fs::write(other.pidfile(), qemu.0.id().to_string()).unwrap();
    assert_eq!(process::find(&other), None);
}

#[test]
fn a_replaced_base_image_or_other_settings_make_another_kind() {
    let dir = tempfile::tempdir().unwrap();
    let (store, p) = provider(dir.path());
    let before = p.kind().unwrap();
    assert_eq!(p.kind().unwrap(), before, "stable");
    std::thread::sleep(Duration::from_millis(20));
    std::fs::write(dir.path().join("base.qcow2"), b"a new build").unwrap();
    assert_ne!(p.kind().unwrap().fingerprint, before.fingerprint);

    // A same-size build copied over it keeping the old mtime (`cp -p`,
    // `rsync -t`): pins.rs pins it anew, so the warm VMs of the old build
    // must go too.
    let base = dir.path().join("base.qcow2");
    let mtime = std::fs::metadata(&base).unwrap().modified().unwrap();
    let before = p.kind().unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let f = std::fs::OpenOptions::new().write(true).open(&base).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, b"A NEW BUILD", 0).unwrap();
    f.set_modified(mtime).unwrap();
    drop(f);
    assert_eq!(std::fs::metadata(&base).unwrap().modified().unwrap(), mtime);
    assert_ne!(p.kind().unwrap().fingerprint, before.fingerprint);
    let mut settings = Settings::default();
    settings.qemu = p.settings.clone();
    settings.qemu.memory_mib += 512;
    let bigger = QemuProvider::new(&settings, &store);
    assert_ne!(
        bigger.kind().unwrap().fingerprint,
        p.kind().unwrap().fingerprint
    );
}

#[test]
fn only_a_default_image_spec_fits() {
    let dir = tempfile::tempdir().unwrap();
    let (store, p) = provider(dir.path());
    let id = uuid::Uuid::new_v4();
    let mut spec = MachineSpec {
        env_id: id,
        name: MachineSpec::machine_name(id),
        runner_id: "1".into(),
        system_id: "s".into(),
        project_id: 1,
        job_id: 1,
        image: None,
        variables: Default::default(),
        ssh_public_key: None,
        paths: store.env_paths(id),
        volume: None,
    };
    assert!(p.fits(&spec));
    spec.image = Some("default".into());
    assert!(p.fits(&spec));
    spec.image = Some("ubuntu".into());
    assert!(!p.fits(&spec));
    spec.image = None;
    spec.volume = Some(crate::model::Volume::new("v"));
    assert!(
        p.fits(&spec),
        "a volume-mode one too: its disk is hot-plugged"
    );
}
