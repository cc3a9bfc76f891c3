//! The seccomp filter every sandboxed command runs under: defence in depth behind the
//! namespaces, rlimits and the dropped capabilities.
//!
//! Everything is allowed except the system calls that reach the kernel's most exposed
//! surfaces, which fail with `EPERM` (so a program sees an ordinary refusal, not a kill):
//! tracing other processes (`ptrace`, `process_vm_readv`/`writev`), mounting (the classic and
//! the new mount API), `kexec`, kernel modules, `bpf`, `perf_event_open`, the keyring calls,
//! `userfaultfd`, and new user namespaces (`unshare` or `clone` with `CLONE_NEWUSER`).
//! `clone3` passes its flags in memory a filter cannot read, so it fails with `ENOSYS`, which
//! makes the C library fall back to `clone`, whose flags the filter checks.
//!
//! The program is compiled once per process with `seccompiler` (rust-vmm's compiler, the one
//! Firecracker uses) before any sandbox is cloned: the code after the clone may not allocate,
//! so it only hands the ready program to the kernel ([`install`]).

use std::collections::BTreeMap;
use std::sync::OnceLock;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// System calls refused with `EPERM` whatever their arguments.
const REFUSED: &[libc::c_long] = &[
    libc::SYS_ptrace,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_open_tree,
    libc::SYS_move_mount,
    libc::SYS_fsopen,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_fspick,
    libc::SYS_mount_setattr,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_keyctl,
    libc::SYS_userfaultfd,
    libc::SYS_setns,
];

/// A filter that allows every call except those of `rules`, which fail with `errno`.
fn refuse(
    rules: BTreeMap<i64, Vec<SeccompRule>>,
    errno: i32,
    arch: TargetArch,
) -> Result<BpfProgram, String> {
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(errno as u32),
        arch,
    )
    .map_err(|e| format!("building the seccomp filter: {e}"))?;
    filter
        .try_into()
        .map_err(|e| format!("compiling the seccomp filter: {e}"))
}

/// Compiles the two filters (see the module docs).
fn build() -> Result<Programs, String> {
    let arch: TargetArch = std::env::consts::ARCH
        .try_into()
        .map_err(|e| format!("building the seccomp filter: {e}"))?;
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        REFUSED.iter().map(|&nr| (nr, Vec::new())).collect();
    // `unshare(flags)` and `clone(flags, ...)`: the flags are the first argument on the
    // architectures seccompiler builds for (x86_64, aarch64).
    let new_user_ns = || {
        let cond = SeccompCondition::new(
            0,
            SeccompCmpArgLen::Qword,
            SeccompCmpOp::MaskedEq(libc::CLONE_NEWUSER as u64),
            libc::CLONE_NEWUSER as u64,
        )
        .map_err(|e| format!("building the seccomp filter: {e}"))?;
        SeccompRule::new(vec![cond])
            .map(|r| vec![r])
            .map_err(|e| format!("building the seccomp filter: {e}"))
    };
    rules.insert(libc::SYS_unshare, new_user_ns()?);
    rules.insert(libc::SYS_clone, new_user_ns()?);
    Ok(Programs {
        eperm: refuse(rules, libc::EPERM, arch)?,
        enosys: refuse(
            BTreeMap::from([(libc::SYS_clone3, Vec::new())]),
            libc::ENOSYS,
            arch,
        )?,
    })
}

/// The two compiled programs: the kernel runs every installed filter and takes the most
/// restrictive answer, so each needs no knowledge of the other.
#[derive(Debug)]
pub(super) struct Programs {
    eperm: BpfProgram,
    enosys: BpfProgram,
}

/// The compiled filters, built once per process.
pub(super) fn programs() -> Result<&'static Programs, String> {
    static PROGRAMS: OnceLock<Result<Programs, String>> = OnceLock::new();
    PROGRAMS.get_or_init(build).as_ref().map_err(Clone::clone)
}

/// Installs the filters on the calling thread (after `PR_SET_NO_NEW_PRIVS`). Makes only
/// system calls on memory built beforehand, so it is safe after a clone of a threaded parent.
///
/// # Safety
/// Called in the sandbox's command process just before it execs.
pub(super) unsafe fn install(p: &Programs) -> Result<(), ()> {
    for prog in [&p.eperm, &p.enosys] {
        let fprog = libc::sock_fprog {
            len: prog.len() as libc::c_ushort,
            filter: prog.as_ptr() as *mut libc::sock_filter,
        };
        let r = libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER as libc::c_long,
            0 as libc::c_long,
            &fprog as *const libc::sock_fprog,
        );
        if r != 0 {
            return Err(());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_filters_compile_for_this_machine() {
        let p = super::programs().expect("compiles");
        assert!(!p.eperm.is_empty() && !p.enosys.is_empty());
    }
}
