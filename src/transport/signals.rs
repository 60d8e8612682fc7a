//! A job's script starts with every signal at its default disposition and
//! none blocked, however dormant itself was started: as sshd and systemd
//! give their children. A runner started under `nohup` (or by a CI agent that
//! ignores SIGHUP) passes SIGHUP ignored to everything it starts, and a
//! disposition ignored on entry cannot even be trapped by bash: without this,
//! a script's `trap ... HUP` would silently do nothing, and a HUP meant to end
//! its processes would not.

/// Resets every signal's disposition to the default and unblocks them all.
/// For a forked child before exec: async-signal-safe (sigaction,
/// sigprocmask), touches no memory but its own stack.
pub fn reset_in_child() -> std::io::Result<()> {
    // SAFETY: plain syscalls on this process's own signal state, with
    // zero-initialised structs they only read.
    unsafe {
        // The kernel's own call: glibc's `sigaction` refuses the two
        // real-time signals it reserves (32, 33), which a parent may still
        // have left ignored. All zeros: SIG_DFL, no flags, an empty mask.
        let action = [0u64; 4];
        for signal in 1..=libc::SIGRTMAX() {
            if signal == libc::SIGKILL || signal == libc::SIGSTOP {
                continue;
            }
            libc::syscall(
                libc::SYS_rt_sigaction,
                signal,
                action.as_ptr(),
                std::ptr::null_mut::<u64>(),
                8usize,
            );
        }
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        if libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut()) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::CommandExt;

    /// A child started with SIGHUP ignored (as under `nohup`) gets it back.
    #[test]
    fn a_child_starts_with_default_dispositions_whatever_its_parent_ignored() {
        let sigign = |reset: bool| {
            let mut cmd = std::process::Command::new("sh");
            cmd.args(["-c", "exec grep SigIgn /proc/self/status"]);
            // SAFETY: the closure calls only async-signal-safe functions.
            unsafe {
                cmd.pre_exec(move || {
                    libc::signal(libc::SIGHUP, libc::SIG_IGN);
                    libc::signal(libc::SIGQUIT, libc::SIG_IGN);
                    if reset {
                        super::reset_in_child()?;
                    }
                    Ok(())
                });
            }
            let out = cmd.output().unwrap();
            let text = String::from_utf8(out.stdout).unwrap();
            let mask = text
                .trim()
                .strip_prefix("SigIgn:")
                .unwrap()
                .trim()
                .to_string();
            u64::from_str_radix(&mask, 16).unwrap()
        };
        // Bits 0 and 2: SIGHUP (1) and SIGQUIT (3). Without the reset they
        // stay ignored (with whatever else this test's runner ignored).
        assert_eq!(sigign(false) & 0b101, 0b101);
        assert_eq!(sigign(true), 0, "every signal back at its default");
    }
}
