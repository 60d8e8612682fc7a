//! The event log's vocabulary: what happened (`Kind`, the `event` field of
//! a line) and why (the causes, the `cause` field), and every (event, cause)
//! pair dormant writes — the list `dormant metrics` prints a zero for before
//! it first happens. The line itself and its builders are `events/mod.rs`.

/// What happened. The strings are the `event` field of a line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A new environment is ready for its job (prepare finished).
    Created,
    /// A suspended environment runs again, for a job or a shell.
    Resumed,
    /// The machine was stopped, the environment kept (a failed stop keeps it too).
    Suspended,
    /// The machine and the environment's files are deleted.
    Released,
    /// A step on the machine failed.
    Failed,
    /// A claim whose holder was gone was taken over and settled.
    Recovered,
    /// A sweep's summary.
    Sweep,
    /// A job's resume was refused (its cause: [`RefuseCause`]); the
    /// environment is as it was.
    Refused,
    /// The notify hook failed (its cause: the hook's event, `suspend`,
    /// `resume`, `release`, `expire`); whatever it was told of happened.
    NotifyFailed,
    /// A suspended environment whose record was lost with its runner-manager
    /// host, taken over by this one (`dormant adopt`).
    Adopted,
    /// A warm machine (booted ahead of any job) was launched, became ready,
    /// was taken by an environment, or retired; or a prepare found none
    /// (`missed`). Its cause says which ([`WARM_CAUSES`]).
    Warm,
    /// Someone joined a running job: `dormant attach` to watch it, or
    /// `dormant shell` beside it ([`JOINED_CAUSES`]); `user` says who.
    Joined,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Created => "created",
            Kind::Resumed => "resumed",
            Kind::Suspended => "suspended",
            Kind::Released => "released",
            Kind::Failed => "failed",
            Kind::Recovered => "recovered",
            Kind::Sweep => "sweep",
            Kind::Refused => "refused",
            Kind::NotifyFailed => "notify_failed",
            Kind::Adopted => "adopted",
            Kind::Warm => "warm",
            Kind::Joined => "joined",
        }
    }
}

/// Why an environment was suspended (the `cause` of a `suspended` line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SuspendCause {
    /// The job's outcome matched its `suspend_on_success` / `suspend_on_failure`.
    Triggers,
    /// The job asked through `DORMANT_SUSPEND_FILE`.
    JobRequest,
    /// A `dormant shell` ended.
    Shell,
    /// The machine was lost under a running job (an instance gone, a host
    /// down) and the environment's disk kept for a later resume.
    MachineLost,
    /// Put back as it was: a resume whose job never reached a stage, or whose
    /// start or connection failed, or a stop that had not finished.
    Unused,
    /// A stale claim (its holder gone) settled to suspended.
    Recovered,
    /// A job's script asked (`dormant-ask`) and waits, kept alive.
    Paused,
    /// A hot window ended (it passed, or a job needed its slot): the
    /// running machine of a paused environment suspended as its mode does.
    Cooled,
}

impl SuspendCause {
    pub const ALL: [SuspendCause; 8] = [
        SuspendCause::Triggers,
        SuspendCause::JobRequest,
        SuspendCause::Shell,
        SuspendCause::MachineLost,
        SuspendCause::Unused,
        SuspendCause::Recovered,
        SuspendCause::Paused,
        SuspendCause::Cooled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SuspendCause::Triggers => "triggers",
            SuspendCause::JobRequest => "job_request",
            SuspendCause::Shell => "shell",
            SuspendCause::MachineLost => "machine_lost",
            SuspendCause::Unused => "unused",
            SuspendCause::Recovered => "recovered",
            SuspendCause::Paused => "paused",
            SuspendCause::Cooled => "cooled",
        }
    }
}

/// Why an environment was released (the `cause` of a `released` line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseCause {
    /// The job ended and no trigger (nor a request) matched its outcome.
    NoTrigger,
    /// The job was canceled, timed out, or terminated (also during its suspension).
    Canceled,
    /// A new environment whose prepare did not finish.
    PrepareFailed,
    /// The job asked to suspend, but `suspend.enabled = false`.
    SuspendDisabled,
    /// Suspended longer than `suspend.ttl`.
    Ttl,
    /// `dormant release`, or `dormant shell --release`.
    Operator,
    /// `dormant sweep --delete-orphans`: a machine no record knew.
    Orphan,
    /// A stale claim (its holder gone) settled to released.
    Recovered,
    /// A release that had failed, finished by a sweep.
    Retried,
}

impl ReleaseCause {
    pub const ALL: [ReleaseCause; 9] = [
        ReleaseCause::NoTrigger,
        ReleaseCause::Canceled,
        ReleaseCause::PrepareFailed,
        ReleaseCause::SuspendDisabled,
        ReleaseCause::Ttl,
        ReleaseCause::Operator,
        ReleaseCause::Orphan,
        ReleaseCause::Recovered,
        ReleaseCause::Retried,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ReleaseCause::NoTrigger => "no_trigger",
            ReleaseCause::Canceled => "canceled",
            ReleaseCause::PrepareFailed => "prepare_failed",
            ReleaseCause::SuspendDisabled => "suspend_disabled",
            ReleaseCause::Ttl => "ttl",
            ReleaseCause::Operator => "operator",
            ReleaseCause::Orphan => "orphan",
            ReleaseCause::Recovered => "recovered",
            ReleaseCause::Retried => "retried",
        }
    }
}

/// Which step failed (the `cause` of a `failed` line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Making a new machine (prepare).
    Create,
    /// Starting a suspended machine (a resume, a shell).
    Start,
    /// Reaching a made or started machine (SSH readiness, probes).
    Connect,
    /// Stopping a machine to suspend it (kept as suspended all the same).
    Stop,
    /// Deleting a machine (the environment stays `releasing`; a sweep retries).
    Delete,
}

impl Step {
    pub const ALL: [Step; 5] = [
        Step::Create,
        Step::Start,
        Step::Connect,
        Step::Stop,
        Step::Delete,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Step::Create => "create",
            Step::Start => "start",
            Step::Connect => "connect",
            Step::Stop => "stop",
            Step::Delete => "delete",
        }
    }
}

/// Why a job's resume was refused (the `cause` of a `refused` line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefuseCause {
    /// The key does not parse.
    MalformedKey,
    /// The key is another runner manager's (runner id or system id).
    OtherRunner,
    /// The key is for another provider than this runner's.
    OtherProvider,
    /// No such environment in the registry (released, expired, state lost).
    NotFound,
    /// The environment belongs to another project.
    OtherProject,
    /// The key's fields differ from the environment's record.
    AlteredKey,
    /// Held by a live job or shell, within its claim grace, or being released.
    InUse,
    /// The environment's machine no longer exists.
    MachineGone,
    /// The environment's data volume (volume mode) no longer exists.
    VolumeGone,
    /// The provider refused the start (what it says is in `error`).
    Provider,
}

impl RefuseCause {
    pub const ALL: [RefuseCause; 10] = [
        RefuseCause::MalformedKey,
        RefuseCause::OtherRunner,
        RefuseCause::OtherProvider,
        RefuseCause::NotFound,
        RefuseCause::OtherProject,
        RefuseCause::AlteredKey,
        RefuseCause::InUse,
        RefuseCause::MachineGone,
        RefuseCause::VolumeGone,
        RefuseCause::Provider,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RefuseCause::MalformedKey => "malformed_key",
            RefuseCause::OtherRunner => "other_runner",
            RefuseCause::OtherProvider => "other_provider",
            RefuseCause::NotFound => "not_found",
            RefuseCause::OtherProject => "other_project",
            RefuseCause::AlteredKey => "altered_key",
            RefuseCause::InUse => "in_use",
            RefuseCause::MachineGone => "machine_gone",
            RefuseCause::VolumeGone => "volume_gone",
            RefuseCause::Provider => "provider",
        }
    }
}

/// The causes of a `notify_failed` line: the event the hook was told of.
pub const NOTIFY_EVENTS: [&str; 4] = ["suspend", "resume", "release", "expire"];

/// The causes a `recovered` line can carry: what the stale claim was settled to.
pub const RECOVERED_CAUSES: [&str; 3] = ["release", "suspend", "resuspend"];
/// The causes of a `warm` line.
pub const WARM_CAUSES: [&str; 5] = ["launched", "ready", "taken", "missed", "retired"];
/// The causes of a `joined` line: how someone joined a running job.
pub const JOINED_CAUSES: [&str; 2] = ["attach", "shell"];
/// The scopes of a `sweep` line (its cause).
pub const SWEEP_SCOPES: [&str; 2] = ["full", "slice"];

/// Every (event, cause) pair dormant writes. `dormant metrics` prints a zero
/// for each one not seen yet, so a dashboard has a series to plot from the
/// first scrape (a counter that appears only at its first increment makes
/// `rate` and `increase` miss that increment, and a panel say "No data").
pub fn known_causes() -> Vec<(&'static str, &'static str)> {
    let mut out = vec![
        (Kind::Created.as_str(), "job"),
        (Kind::Resumed.as_str(), "job"),
        (Kind::Resumed.as_str(), "hot"),
        (Kind::Resumed.as_str(), "shell"),
    ];
    out.extend(
        SuspendCause::ALL
            .iter()
            .map(|c| (Kind::Suspended.as_str(), c.as_str())),
    );
    out.extend(
        ReleaseCause::ALL
            .iter()
            .map(|c| (Kind::Released.as_str(), c.as_str())),
    );
    out.extend(
        Step::ALL
            .iter()
            .map(|c| (Kind::Failed.as_str(), c.as_str())),
    );
    out.extend(
        RECOVERED_CAUSES
            .iter()
            .map(|c| (Kind::Recovered.as_str(), *c)),
    );
    out.extend(SWEEP_SCOPES.iter().map(|c| (Kind::Sweep.as_str(), *c)));
    out.extend(
        RefuseCause::ALL
            .iter()
            .map(|c| (Kind::Refused.as_str(), c.as_str())),
    );
    out.extend(
        NOTIFY_EVENTS
            .iter()
            .map(|c| (Kind::NotifyFailed.as_str(), *c)),
    );
    // `dormant adopt` is the one source of adoptions.
    out.push((Kind::Adopted.as_str(), "operator"));
    out.extend(WARM_CAUSES.iter().map(|c| (Kind::Warm.as_str(), *c)));
    out.extend(JOINED_CAUSES.iter().map(|c| (Kind::Joined.as_str(), *c)));
    out
}
