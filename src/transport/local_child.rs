//! How a direct local stage's script is started ([`super::local`]): the
//! memory file it is read from, what its shell does between fork and exec,
//! and the watchdog that leads its process group.
//!
//! The script never touches a disk: it goes into an anonymous memory file
//! (`memfd_create`) that bash reads as `/dev/fd/3` — a file, so bash reads it
//! in blocks and a command in the script that reads stdin cannot swallow the
//! rest — and that vanishes with the last process holding it, whatever kills
//! dormant. It starts with every signal at its default ([`super::signals`]),
//! whatever dormant was started with.
//!
//! If dormant dies (even by SIGKILL), the script's whole process group goes
//! with it: the shell by `PR_SET_PDEATHSIG`, and every other member by a
//! watchdog — a fork of dormant that leads the script's group (it is forked
//! first and the script's shell joins its group, so the group never lives
//! unguarded, however early dormant dies), and holds nothing but the read
//! end of a pipe only dormant writes to. When dormant goes, the
//! pipe ends and the watchdog kills the group, itself included. (A member
//! would otherwise live on until its next write to the closed output fails,
//! or for ever if it never writes.)

use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// The script's first line: its shell closes the memory file it reads the
/// script from (bash has its own descriptor), so nothing the script starts inherits it.
const PRELUDE: &[u8] = b"exec 3<&-\n";

/// An anonymous in-memory file holding the prelude and the script.
pub(super) fn memory_file(body: &[u8]) -> std::io::Result<OwnedFd> {
    // SAFETY: a NUL-terminated name; the returned descriptor is checked and owned.
    let fd = unsafe { libc::memfd_create(c"dormant-stage-script".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and is owned by nothing else.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut f = std::fs::File::from(owned);
    f.write_all(PRELUDE)?;
    f.write_all(body)?;
    Ok(OwnedFd::from(f))
}

/// In the forked child: the script file as fd 3 (without close-on-exec), and
/// death with dormant.
pub(super) fn child_setup(script_fd: i32, parent: libc::pid_t) -> std::io::Result<()> {
    super::signals::reset_in_child()?;
    // SAFETY: plain syscalls on descriptors of this process.
    unsafe {
        if script_fd == 3 {
            if libc::fcntl(3, libc::F_SETFD, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
        } else if libc::dup2(script_fd, 3) < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // dormant died before the signal was armed.
        if libc::getppid() != parent {
            return Err(std::io::Error::other("dormant exited"));
        }
    }
    Ok(())
}

/// The watchdog of a script's process group (see the module comment).
/// Dropped when the stage is over: it reaps the watchdog, which by then has
/// been killed with the group or sees its pipe end.
pub(super) struct Watchdog {
    /// The watchdog's pid, the script's process group.
    pub(super) pid: libc::pid_t,
    /// Held only by dormant (close-on-exec): its end is dormant's end.
    _alive: OwnedFd,
}

impl Watchdog {
    /// Forks the watchdog as the leader of a new process group, for the
    /// script to join; its pipe's write end lives as long as the value.
    pub(super) fn start() -> std::io::Result<Watchdog> {
        let mut fds = [0; 2];
        // SAFETY: pipe2 writes two descriptors into the array it is given.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: both descriptors were just created and are owned here.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let read_fd = read.as_raw_fd();
        // SAFETY: the child calls only async-signal-safe functions (setpgid,
        // sigaction, dup2, close_range, read, kill, _exit) and never returns.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if pid == 0 {
            // SAFETY: see above.
            unsafe { watch(read_fd) }
        }
        // Both sides make the group (whichever runs first): it exists once
        // this returns, for the script's shell to join.
        // SAFETY: setpgid on our own child.
        unsafe {
            libc::setpgid(pid, pid);
        }
        drop(read);
        Ok(Watchdog { pid, _alive: write })
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        // Its pipe ends with this value (the field drops after this), so it
        // may still be alive: killed with the group just before, or about to
        // see the end of its pipe. Either takes microseconds.
        // SAFETY: the watchdog is our child; kill and waitpid touch no memory of ours.
        unsafe {
            libc::kill(self.pid, libc::SIGKILL);
            libc::waitpid(self.pid, std::ptr::null_mut(), 0);
        }
    }
}

/// The watchdog's life, in the forked child: lead a new group (the script's),
/// ignore every signal a script sends its group (only SIGKILL ends it), hold
/// nothing but the pipe, and kill the group when the pipe ends.
unsafe fn watch(pipe: i32) -> ! {
    let pgid = libc::getpid();
    if libc::setpgid(0, pgid) != 0 {
        libc::_exit(1);
    }
    for signal in 1..libc::SIGRTMAX() {
        if signal != libc::SIGKILL && signal != libc::SIGSTOP {
            libc::signal(signal, libc::SIG_IGN);
        }
    }
    if libc::dup2(pipe, 0) < 0 {
        libc::_exit(1);
    }
    // Not the runner's pipes, nor anything else of dormant's.
    if libc::syscall(libc::SYS_close_range, 1u32, u32::MAX, 0u32) != 0 {
        for fd in 1..4096 {
            libc::close(fd);
        }
    }
    let mut byte = 0u8;
    loop {
        let n = libc::read(0, (&raw mut byte).cast(), 1);
        if n == 0 || (n < 0 && *libc::__errno_location() != libc::EINTR) {
            break;
        }
    }
    libc::kill(-pgid, libc::SIGKILL);
    libc::_exit(0)
}

/// Signals every process of the group `pgid`.
pub(super) fn kill_group(pgid: i32, signal: i32) {
    // SAFETY: kill(2) with a negative pid signals a process group; no memory is touched.
    unsafe {
        libc::kill(-pgid, signal);
    }
}
