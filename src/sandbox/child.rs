//! The code that runs after the clone: the sandbox init (pid 1 of the new pid namespace) and,
//! forked from it, the command. The parent may have many threads, so this code only makes
//! system calls on data prepared beforehand: it never allocates, locks or panics. Setuid-family
//! calls are raw system calls (glibc's wrappers would try to signal the parent's threads).
//!
//! Reports go to the host over the report pipe as 12-byte records `[kind, a, b]` (native
//! endian `u32, u32, i32`): [`REPORT_SETUP`] (a step, errno), [`REPORT_EXEC`] (candidate
//! index, errno) and [`REPORT_STATUS`] (0, wait status).

use std::ffi::{c_char, c_int, c_long};
use std::ptr;

use super::plan::{Op, Plan};

pub(super) const REPORT_SETUP: u32 = 1;
pub(super) const REPORT_EXEC: u32 = 2;
pub(super) const REPORT_STATUS: u32 = 3;

/// Setup steps outside the plan's ops (ops are reported as `STEP_OP + index`).
pub(super) const STEP_FDS: u32 = 1;
pub(super) const STEP_PRIVATE: u32 = 2;
pub(super) const STEP_BASE: u32 = 3;
pub(super) const STEP_PIVOT_BASE: u32 = 4;
pub(super) const STEP_NEWROOT: u32 = 5;
pub(super) const STEP_DETACH_OLD: u32 = 6;
pub(super) const STEP_PIVOT_NEW: u32 = 7;
pub(super) const STEP_RO_ROOT: u32 = 8;
pub(super) const STEP_HOSTNAME: u32 = 9;
pub(super) const STEP_FORK: u32 = 10;
pub(super) const STEP_RLIMIT: u32 = 11;
pub(super) const STEP_IDS: u32 = 12;
pub(super) const STEP_NNP: u32 = 13;
pub(super) const STEP_CHDIR: u32 = 14;
pub(super) const STEP_SIGNALS: u32 = 15;
pub(super) const STEP_SECCOMP: u32 = 16;
pub(super) const STEP_CGROUP_NS: u32 = 17;
pub(super) const STEP_OP: u32 = 100;

/// The uid and gid of the command inside the sandbox.
pub(super) const INSIDE_ID: u32 = 1000;

/// Fds the init is handed, as numbered in the parent.
pub(super) struct Fds {
    pub stdin: c_int,
    pub stdout: c_int,
    pub stderr: c_int,
    pub sync: c_int,
    pub report: c_int,
}

/// Argument and environment pointer arrays (NULL-terminated), built before the clone.
pub(super) struct Exec<'a> {
    pub plan: &'a Plan,
    pub argv: Vec<*const c_char>,
    pub envp: Vec<*const c_char>,
}

impl<'a> Exec<'a> {
    pub(super) fn new(plan: &'a Plan) -> Self {
        let mut argv: Vec<*const c_char> = plan.argv.iter().map(|a| a.as_ptr()).collect();
        argv.push(ptr::null());
        let mut envp: Vec<*const c_char> = plan.envp.iter().map(|a| a.as_ptr()).collect();
        envp.push(ptr::null());
        Exec { plan, argv, envp }
    }
}

const REPORT_FD: c_int = 4;
const SYNC_FD: c_int = 3;

const AT_RECURSIVE: u32 = 0x8000;
const MOUNT_ATTR_RDONLY: u64 = 0x1;
const MOUNT_ATTR_NOSUID: u64 = 0x2;
const MOUNT_ATTR_NODEV: u64 = 0x4;

#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

unsafe fn report(kind: u32, a: u32, b: i32) {
    let mut buf = [0u8; 12];
    buf[0..4].copy_from_slice(&kind.to_ne_bytes());
    buf[4..8].copy_from_slice(&a.to_ne_bytes());
    buf[8..12].copy_from_slice(&b.to_ne_bytes());
    libc::write(REPORT_FD, buf.as_ptr().cast(), buf.len());
}

unsafe fn fail(step: u32) -> ! {
    report(REPORT_SETUP, step, errno());
    libc::_exit(126)
}

fn check(r: c_long) -> Result<(), ()> {
    if r < 0 {
        Err(())
    } else {
        Ok(())
    }
}

unsafe fn mount(
    src: *const c_char,
    dst: *const c_char,
    fs: *const c_char,
    flags: libc::c_ulong,
    data: *const c_char,
) -> Result<(), ()> {
    check(libc::mount(src, dst, fs, flags, data.cast()) as c_long)
}

/// Sets `attr` on the mount at `path` (and below when `recursive`); falls back to a bind
/// remount of the top mount on kernels without `mount_setattr`.
unsafe fn restrict(path: *const c_char, attr: u64, recursive: bool) -> Result<(), ()> {
    let mut ma = MountAttr {
        attr_set: attr,
        attr_clr: 0,
        propagation: 0,
        userns_fd: 0,
    };
    let r = libc::syscall(
        libc::SYS_mount_setattr,
        libc::AT_FDCWD,
        path,
        if recursive { AT_RECURSIVE } else { 0 },
        &mut ma as *mut MountAttr,
        std::mem::size_of::<MountAttr>(),
    );
    if r == 0 {
        return Ok(());
    }
    if errno() != libc::ENOSYS {
        return Err(());
    }
    let mut st: libc::statvfs = std::mem::zeroed();
    if libc::statvfs(path, &mut st) != 0 {
        return Err(());
    }
    // ST_* flag bits equal the MS_* ones; locked flags must be kept.
    let keep = (st.f_flag as libc::c_ulong)
        & (libc::MS_NOEXEC
            | libc::MS_NOATIME
            | libc::MS_NODIRATIME
            | libc::MS_RELATIME
            | libc::MS_NOSUID
            | libc::MS_NODEV
            | libc::MS_RDONLY);
    let mut flags = keep | libc::MS_REMOUNT | libc::MS_BIND;
    if attr & MOUNT_ATTR_RDONLY != 0 {
        flags |= libc::MS_RDONLY;
    }
    if attr & MOUNT_ATTR_NOSUID != 0 {
        flags |= libc::MS_NOSUID;
    }
    if attr & MOUNT_ATTR_NODEV != 0 {
        flags |= libc::MS_NODEV;
    }
    mount(ptr::null(), path, ptr::null(), flags, ptr::null())
}

unsafe fn run_op(op: &Op) -> Result<(), ()> {
    match op {
        Op::Mkdir(p) => {
            if libc::mkdir(p.as_ptr(), 0o755) != 0 && errno() != libc::EEXIST {
                return Err(());
            }
            Ok(())
        }
        Op::Touch(p) => {
            let fd = libc::open(
                p.as_ptr(),
                libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC,
                0o644,
            );
            if fd < 0 {
                return Err(());
            }
            libc::close(fd);
            Ok(())
        }
        Op::Symlink { target, link } => {
            check(libc::symlink(target.as_ptr(), link.as_ptr()) as c_long)
        }
        Op::Write { path, contents } => {
            let fd = libc::open(
                path.as_ptr(),
                libc::O_CREAT | libc::O_WRONLY | libc::O_TRUNC | libc::O_CLOEXEC,
                0o644,
            );
            if fd < 0 {
                return Err(());
            }
            let mut off = 0;
            while off < contents.len() {
                let n = libc::write(fd, contents[off..].as_ptr().cast(), contents.len() - off);
                if n < 0 {
                    if errno() == libc::EINTR {
                        continue;
                    }
                    libc::close(fd);
                    return Err(());
                }
                off += n as usize;
            }
            libc::close(fd);
            Ok(())
        }
        Op::Tmpfs { dst, data, noexec } => {
            let mut flags = libc::MS_NOSUID | libc::MS_NODEV;
            if *noexec {
                flags |= libc::MS_NOEXEC;
            }
            mount(
                c"tmpfs".as_ptr(),
                dst.as_ptr(),
                c"tmpfs".as_ptr(),
                flags,
                data.as_ptr(),
            )
        }
        Op::Bind {
            src,
            dst,
            readonly,
            device,
        } => {
            mount(
                src.as_ptr(),
                dst.as_ptr(),
                ptr::null(),
                libc::MS_BIND | libc::MS_REC,
                ptr::null(),
            )?;
            let mut attr = MOUNT_ATTR_NOSUID;
            if !*device {
                attr |= MOUNT_ATTR_NODEV;
            }
            if *readonly {
                attr |= MOUNT_ATTR_RDONLY;
            }
            restrict(dst.as_ptr(), attr, true)
        }
        Op::Sysctl { path, value } => {
            let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if fd < 0 {
                return if errno() == libc::ENOENT {
                    Ok(())
                } else {
                    Err(())
                };
            }
            let n = libc::write(fd, value.as_ptr().cast(), value.len());
            libc::close(fd);
            if n != value.len() as isize {
                return Err(());
            }
            Ok(())
        }
        Op::Proc { dst, data } => mount(
            c"proc".as_ptr(),
            dst.as_ptr(),
            c"proc".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            data.as_ptr(),
        ),
    }
}

/// Moves the fds the init needs to 0, 1, 2 (the command's stdio), 3 (sync) and 4 (report,
/// close-on-exec) and closes every other fd inherited from the parent.
unsafe fn arrange_fds(fds: &Fds) -> Result<(), ()> {
    let wanted = [fds.stdin, fds.stdout, fds.stderr, fds.sync, fds.report];
    let floor = wanted.iter().copied().max().unwrap_or(0).max(16) + 1;
    let mut tmp = [0 as c_int; 5];
    for (t, &fd) in tmp.iter_mut().zip(wanted.iter()) {
        let n = libc::fcntl(fd, libc::F_DUPFD, floor);
        if n < 0 {
            return Err(());
        }
        *t = n;
    }
    for (i, &t) in tmp.iter().enumerate() {
        if libc::dup2(t, i as c_int) < 0 {
            return Err(());
        }
    }
    if libc::syscall(libc::SYS_close_range, 5u32, u32::MAX, 0u32) != 0 {
        let mut rl: libc::rlimit = std::mem::zeroed();
        let max = if libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) == 0 {
            rl.rlim_cur.min(1 << 20) as c_int
        } else {
            4096
        };
        for fd in 5..max {
            libc::close(fd);
        }
    }
    if libc::fcntl(REPORT_FD, libc::F_SETFD, libc::FD_CLOEXEC) < 0 {
        return Err(());
    }
    Ok(())
}

/// Sets every catchable signal to its default disposition.
unsafe fn reset_signals() {
    let mut sa: libc::sigaction = std::mem::zeroed();
    sa.sa_sigaction = libc::SIG_DFL;
    libc::sigemptyset(&mut sa.sa_mask);
    for sig in 1..=64 {
        if sig != libc::SIGKILL && sig != libc::SIGSTOP {
            // Fails harmlessly for the signals glibc reserves.
            libc::sigaction(sig, &sa, ptr::null_mut());
        }
    }
}

/// The sandbox init. Never returns.
///
/// # Safety
/// Must be called only in the child of a `clone` with new user, mount, pid, net, ipc and uts
/// namespaces, with `fds` valid there.
pub(super) unsafe fn init(ex: &Exec<'_>, fds: &Fds) -> ! {
    let f = &ex.plan.fixed;
    // The host's signal handlers (e.g. tokio's SIGCHLD handler) must never run here: they use
    // host memory that is unmapped below. Default dispositions also undo an ignored SIGPIPE.
    reset_signals();
    if arrange_fds(fds).is_err() {
        // The report fd may be unusable; exit with a distinct code.
        libc::_exit(125);
    }
    // Wait for the host to write the uid/gid maps (EOF: it gave up).
    let mut b = 0u8;
    loop {
        let n = libc::read(SYNC_FD, (&mut b as *mut u8).cast(), 1);
        if n == 1 {
            break;
        }
        if n < 0 && errno() == libc::EINTR {
            continue;
        }
        libc::_exit(125);
    }
    // The sync pipe stays open: its end of file tells the init that the host died.
    if libc::fcntl(SYNC_FD, libc::F_SETFD, libc::FD_CLOEXEC) < 0 {
        fail(STEP_FDS);
    }
    // The host has moved the init into the sandbox's cgroup (when there is one) before the
    // sync byte: a cgroup namespace rooted there shows the sandbox its own cgroup as `/`.
    if libc::unshare(libc::CLONE_NEWCGROUP) != 0 {
        fail(STEP_CGROUP_NS);
    }

    // Nothing propagates back to the host.
    if mount(
        ptr::null(),
        f.root.as_ptr(),
        ptr::null(),
        libc::MS_REC | libc::MS_PRIVATE,
        ptr::null(),
    )
    .is_err()
    {
        fail(STEP_PRIVATE);
    }
    // A scratch tmpfs becomes the root; the old root stays reachable at /oldroot.
    if mount(
        f.tmpfs.as_ptr(),
        f.tmp.as_ptr(),
        f.tmpfs.as_ptr(),
        libc::MS_NOSUID | libc::MS_NODEV,
        f.base_data.as_ptr(),
    )
    .is_err()
        || libc::mkdir(f.tmp_old.as_ptr(), 0o755) != 0
    {
        fail(STEP_BASE);
    }
    if libc::syscall(libc::SYS_pivot_root, f.tmp.as_ptr(), f.tmp_old.as_ptr()) != 0
        || libc::chdir(f.root.as_ptr()) != 0
    {
        fail(STEP_PIVOT_BASE);
    }
    if libc::mkdir(f.new.as_ptr(), 0o755) != 0
        || mount(
            f.tmpfs.as_ptr(),
            f.new.as_ptr(),
            f.tmpfs.as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            f.new_data.as_ptr(),
        )
        .is_err()
    {
        fail(STEP_NEWROOT);
    }
    for (i, op) in ex.plan.ops.iter().enumerate() {
        if run_op(op).is_err() {
            fail(STEP_OP + i as u32);
        }
    }
    if libc::umount2(f.old.as_ptr(), libc::MNT_DETACH) != 0 {
        fail(STEP_DETACH_OLD);
    }
    if libc::chdir(f.new.as_ptr()) != 0
        || libc::syscall(libc::SYS_pivot_root, f.dot.as_ptr(), f.dot.as_ptr()) != 0
        || libc::umount2(f.dot.as_ptr(), libc::MNT_DETACH) != 0
        || libc::chdir(f.root.as_ptr()) != 0
    {
        fail(STEP_PIVOT_NEW);
    }
    let ro = libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV;
    if mount(ptr::null(), f.root.as_ptr(), ptr::null(), ro, ptr::null()).is_err()
        || mount(
            ptr::null(),
            f.dev.as_ptr(),
            ptr::null(),
            ro | libc::MS_NOEXEC,
            ptr::null(),
        )
        .is_err()
    {
        fail(STEP_RO_ROOT);
    }
    if libc::sethostname(f.hostname.as_ptr(), f.hostname.as_bytes().len()) != 0 {
        fail(STEP_HOSTNAME);
    }

    // SIGCHLD is taken through a signalfd so the init can wait for children and for the
    // host's end of the sync pipe (closed when the host dies) at once.
    let mut chld: libc::sigset_t = std::mem::zeroed();
    libc::sigemptyset(&mut chld);
    libc::sigaddset(&mut chld, libc::SIGCHLD);
    if libc::sigprocmask(libc::SIG_BLOCK, &chld, ptr::null_mut()) != 0 {
        fail(STEP_SIGNALS);
    }
    let sfd = libc::signalfd(-1, &chld, libc::SFD_CLOEXEC | libc::SFD_NONBLOCK);
    if sfd < 0 {
        fail(STEP_SIGNALS);
    }
    let pid = libc::syscall(
        libc::SYS_clone,
        libc::SIGCHLD as c_long,
        0 as c_long,
        0 as c_long,
        0 as c_long,
        0 as c_long,
    );
    if pid < 0 {
        fail(STEP_FORK);
    }
    if pid == 0 {
        command(ex);
    }
    libc::close(0);
    libc::close(1);
    libc::close(2);
    shed_host_memory();
    // From here on only raw system calls, the stack and errno are used.
    let mut polls = [
        libc::pollfd {
            fd: sfd,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: SYNC_FD,
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    loop {
        // Reap everything that is ready: the command, and orphans reparented to the init.
        loop {
            let mut status: c_int = 0;
            let r = libc::syscall(
                libc::SYS_wait4,
                -1 as c_long,
                &mut status as *mut c_int,
                libc::WNOHANG as c_long,
                ptr::null_mut::<libc::rusage>(),
            );
            if r == pid {
                let mut buf = [0u8; 12];
                buf[0..4].copy_from_slice(&REPORT_STATUS.to_ne_bytes());
                buf[8..12].copy_from_slice(&status.to_ne_bytes());
                libc::syscall(
                    libc::SYS_write,
                    REPORT_FD as c_long,
                    buf.as_ptr(),
                    12 as c_long,
                );
                libc::syscall(libc::SYS_exit_group, 0 as c_long);
            }
            if r == 0 {
                break;
            }
            if r < 0 && errno() != libc::EINTR {
                libc::syscall(libc::SYS_exit_group, 0 as c_long);
            }
        }
        polls[0].revents = 0;
        polls[1].revents = 0;
        let n = libc::syscall(
            libc::SYS_poll,
            polls.as_mut_ptr(),
            2 as c_long,
            -1 as c_long,
        );
        if n < 0 {
            continue;
        }
        if polls[1].revents != 0 {
            // The host is gone (or gave up): the whole namespace dies with the init.
            libc::syscall(libc::SYS_exit_group, 0 as c_long);
        }
        if polls[0].revents != 0 {
            let mut info = [0u8; 128];
            while libc::syscall(
                libc::SYS_read,
                sfd as c_long,
                info.as_mut_ptr(),
                128 as c_long,
            ) > 0
            {}
        }
    }
}

/// Unmaps the init's copy of the host's private anonymous writable memory (heap, other threads'
/// stacks, large allocations such as model weights), so that a long-running command does not
/// pin copy-on-write pages of the host. Only the current stack, the mapping holding the
/// thread's TLS (errno) and file-backed mappings are kept. Best effort: on any failure the
/// memory simply stays mapped.
unsafe fn shed_host_memory() {
    let here = 0u8;
    let sp = &here as *const u8 as usize;
    let tls = libc::__errno_location() as usize;
    const BUF: usize = 8 << 20;
    let buf = libc::mmap(
        ptr::null_mut(),
        BUF,
        libc::PROT_READ | libc::PROT_WRITE,
        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
        -1,
        0,
    );
    if buf == libc::MAP_FAILED {
        return;
    }
    let base = buf as usize;
    let fd = libc::open(
        c"/proc/self/maps".as_ptr(),
        libc::O_RDONLY | libc::O_CLOEXEC,
    );
    if fd < 0 {
        libc::munmap(buf, BUF);
        return;
    }
    let mut len = 0usize;
    loop {
        let n = libc::read(fd, (base + len) as *mut libc::c_void, BUF - len);
        if n < 0 && errno() == libc::EINTR {
            continue;
        }
        if n <= 0 {
            break;
        }
        len += n as usize;
        if len == BUF {
            // More maps than the buffer holds: keep everything.
            libc::close(fd);
            libc::munmap(buf, BUF);
            return;
        }
    }
    libc::close(fd);
    let maps = std::slice::from_raw_parts(base as *const u8, len);
    for line in maps.split(|&b| b == b'\n') {
        let Some((start, end)) = releasable(line) else {
            continue;
        };
        let holds = |a: usize| start <= a && a < end;
        if holds(sp) || holds(tls) || holds(base) {
            continue;
        }
        libc::munmap(start as *mut libc::c_void, end - start);
    }
    libc::munmap(buf, BUF);
}

/// The address range of a `/proc/self/maps` line describing private, writable, anonymous
/// memory (unnamed or `[heap]`).
fn releasable(line: &[u8]) -> Option<(usize, usize)> {
    let mut fields = line.split(|&b| b == b' ').filter(|f| !f.is_empty());
    let range = fields.next()?;
    let perms = fields.next()?;
    let _offset = fields.next()?;
    let _dev = fields.next()?;
    let inode = fields.next()?;
    let name = fields.next();
    if perms.len() < 4 || perms[1] != b'w' || perms[3] != b'p' || inode != b"0" {
        return None;
    }
    if let Some(n) = name {
        if n != b"[heap]" {
            return None;
        }
    }
    let dash = range.iter().position(|&b| b == b'-')?;
    let start = hex(&range[..dash])?;
    let end = hex(&range[dash + 1..])?;
    (start < end).then_some((start, end))
}

fn hex(s: &[u8]) -> Option<usize> {
    let mut v: usize = 0;
    if s.is_empty() {
        return None;
    }
    for &c in s {
        let d = match c {
            b'0'..=b'9' => c - b'0',
            b'a'..=b'f' => c - b'a' + 10,
            b'A'..=b'F' => c - b'A' + 10,
            _ => return None,
        };
        v = v.checked_mul(16)?.checked_add(d as usize)?;
    }
    Some(v)
}

/// The command: drops to the sandbox user and execs. Never returns.
unsafe fn command(ex: &Exec<'_>) -> ! {
    let plan = ex.plan;
    // The signal mask starts clean (dispositions were reset by the init).
    let mut set: libc::sigset_t = std::mem::zeroed();
    libc::sigemptyset(&mut set);
    if libc::sigprocmask(libc::SIG_SETMASK, &set, ptr::null_mut()) != 0 {
        fail(STEP_SIGNALS);
    }
    for (res, lim) in &plan.rlimits {
        if libc::setrlimit(*res, lim) != 0 {
            fail(STEP_RLIMIT);
        }
    }
    // Capabilities: empty the bounding set while still privileged; the uid change below
    // clears the permitted and effective sets.
    for cap in 0..64 {
        libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0);
    }
    let id = INSIDE_ID as c_long;
    let no_groups: [libc::gid_t; 0] = [];
    if libc::syscall(libc::SYS_setgroups, 0 as c_long, no_groups.as_ptr()) != 0
        || libc::syscall(libc::SYS_setresgid, id, id, id) != 0
        || libc::syscall(libc::SYS_setresuid, id, id, id) != 0
    {
        fail(STEP_IDS);
    }
    if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
        fail(STEP_NNP);
    }
    if libc::chdir(plan.fixed.work.as_ptr()) != 0 {
        fail(STEP_CHDIR);
    }
    // Last, so the setup above may still make the calls the filter refuses.
    if super::seccomp::install(plan.seccomp).is_err() {
        fail(STEP_SECCOMP);
    }
    // execvp: the first candidate that execs; report the most telling error.
    let mut best: (u32, i32) = (0, libc::ENOENT);
    for (i, cand) in plan.exec_candidates.iter().enumerate() {
        libc::execve(cand.as_ptr(), ex.argv.as_ptr(), ex.envp.as_ptr());
        let e = errno();
        match e {
            libc::ENOENT | libc::ENOTDIR => {}
            libc::EACCES => best = (i as u32, e),
            _ => {
                best = (i as u32, e);
                break;
            }
        }
    }
    report(REPORT_EXEC, best.0, best.1);
    libc::_exit(127)
}

#[cfg(test)]
mod tests {
    use super::releasable;

    #[test]
    fn only_private_writable_anonymous_maps_are_released() {
        let anon = b"7f0000000000-7f0000100000 rw-p 00000000 00:00 0 ";
        assert_eq!(releasable(anon), Some((0x7f00_0000_0000, 0x7f00_0010_0000)));
        let heap =
            b"55d4c8a00000-55d4c8c00000 rw-p 00000000 00:00 0                          [heap]";
        assert_eq!(releasable(heap), Some((0x55d4_c8a0_0000, 0x55d4_c8c0_0000)));
        for kept in [
            &b"7f0000000000-7f0000100000 r--p 00000000 00:00 0 "[..],
            b"7f0000000000-7f0000100000 rw-s 00000000 00:01 1234 /dev/zero (deleted)",
            b"7f0000000000-7f0000100000 rw-p 00001000 fe:00 42 /usr/lib/libc.so.6",
            b"7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0                          [stack]",
            b"garbage",
            b"",
        ] {
            assert_eq!(releasable(kept), None, "{}", String::from_utf8_lossy(kept));
        }
    }
}
