//! Where a browser may reach: what is done between fork and exec so that Chromium runs as
//! [`BROWSER_UID`] with its own sandbox on, in network and mount namespaces of its own, and can
//! write only its episode's browser directory.
//!
//! - **Network.** A new network namespace holds only a loopback that is down: no request the
//!   page makes, whatever the interception lets through, reaches any host.
//! - **User.** The browser drops to [`BROWSER_UID`]/[`BROWSER_GID`] with no supplementary
//!   groups and `no_new_privs`, after the namespaces are made (which needs root). Files of the
//!   node that are not readable by others stay unreadable, whatever the page asks the browser
//!   process to open. Chromium's own sandbox stays on: its renderers, where the page's scripts
//!   run, live in user and pid namespaces of their own under a seccomp filter and cannot open
//!   files at all.
//! - **Files.** In the new mount namespace (private: nothing propagates back to the host) an
//!   empty tmpfs owned by root (mode 0755) covers each world-writable directory and `/run`
//!   ([`COVERED`]) and the highest ancestor of the browser directory that
//!   [`BROWSER_UID`] could not enter anyway (the work dir pool's root is always one: mode
//!   0700). Inside the cover that holds the browser directory, the path down to it is
//!   re-created and the directory itself is bind-mounted there; its `tmp` is bind-mounted at
//!   [`SCRATCH`] (`TMPDIR`). Both are opened before the covers go on. So the browser reaches
//!   its directory at the same path as on the host (process sweeps find it by that path in
//!   command lines), sees no other episode's directory, and finds nowhere else to write.
//!   `/proc` is a procfs of its own with `hidepid=invisible`: the node's other processes,
//!   their command lines included, are not listed.
//!
//! The plan is computed first ([`plan`], pure: it is given whether each ancestor is
//! searchable); [`Prepared::enter`] only replays it with system calls.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

pub use crate::sandbox::{BROWSER_GID, BROWSER_UID};

/// Directories covered by an empty, root-owned tmpfs in the browser's mount namespace, each
/// where it exists: those anyone may write to on a usual Linux host, and `/run`, where daemons
/// keep Unix sockets (which no network namespace stops) and which holds `/run/lock`.
pub const COVERED: [&str; 5] = ["/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue", "/run"];

/// Where the browser's temporary files go (`TMPDIR`) in its namespace: the browser
/// directory's [`SCRATCH_SOURCE`], mounted in the `/tmp` cover at a short path (Chromium makes
/// Unix sockets there, whose paths are limited to 107 bytes).
pub const SCRATCH: &str = "/tmp/clawrl-browser";

/// The subdirectory of the browser directory that is mounted at [`SCRATCH`].
pub const SCRATCH_SOURCE: &str = "tmp";

/// The tmpfs of a cover: root's, searchable, small (it holds only directories).
const COVER_DATA: &std::ffi::CStr = c"mode=0755,size=1m,nr_inodes=256";

/// A directory of the host mounted at another path in the browser's namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bind {
    /// The host directory (opened in the new namespace before any cover goes on).
    pub from: PathBuf,
    /// Where it appears (one of [`Plan::mkdirs`]).
    pub to: PathBuf,
}

/// What the mount namespace of one browser looks like, relative to the host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Directories covered by an empty tmpfs, in mount order (none below another).
    pub covers: Vec<PathBuf>,
    /// Directories made inside the covers, parents first: the path down to the browser
    /// directory inside the cover that holds it, then [`SCRATCH`].
    pub mkdirs: Vec<PathBuf>,
    /// The browser directory back at its own path (when a cover holds it), then its
    /// [`SCRATCH_SOURCE`] at [`SCRATCH`].
    pub binds: Vec<Bind>,
}

/// The most binds a plan has (the browser directory and its scratch).
const MAX_BINDS: usize = 2;

/// Why a browser directory cannot be confined to.
#[derive(Debug, thiserror::Error)]
pub enum ConfineError {
    /// The path is relative, has `.`/`..` components, or meets [`SCRATCH`].
    #[error(
        "the browser directory {0} must be an absolute path without `.` or `..`, apart from \
         {SCRATCH}"
    )]
    Path(PathBuf),
    /// The path holds a NUL byte.
    #[error("{0} contains a NUL byte")]
    Nul(PathBuf),
}

/// Whether a directory with `mode`, owned by `owner:group`, can be entered by `uid:gid` with
/// no supplementary groups (classic permission bits; ACLs are not consulted).
pub fn searchable(mode: u32, owner: u32, group: u32, uid: u32, gid: u32) -> bool {
    let bit = if owner == uid {
        0o100
    } else if group == gid {
        0o010
    } else {
        0o001
    };
    mode & bit != 0
}

/// The mount plan for browser directory `dir` (absolute, normal): `covers_wanted` are the
/// directories of [`COVERED`] present on the host (`/tmp` is covered in any case, to hold
/// [`SCRATCH`]); `enterable(ancestor)` says whether the browser's uid can search an ancestor of
/// `dir` (asked top down, `/` excluded).
pub fn plan(
    dir: &Path,
    covers_wanted: &[PathBuf],
    mut enterable: impl FnMut(&Path) -> bool,
) -> Result<Plan, ConfineError> {
    let normal = dir.components().collect::<PathBuf>().as_os_str() == dir.as_os_str()
        && dir
            .components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
    let scratch = Path::new(SCRATCH);
    if !dir.is_absolute() || !normal || dir.starts_with(scratch) || scratch.starts_with(dir) {
        return Err(ConfineError::Path(dir.to_path_buf()));
    }
    let mut ancestors: Vec<&Path> = dir.ancestors().skip(1).collect();
    ancestors.reverse();
    let closed = ancestors
        .into_iter()
        .filter(|a| a.parent().is_some())
        .find(|a| !enterable(a));
    let mut covers: Vec<PathBuf> = covers_wanted.to_vec();
    covers.extend(scratch.parent().map(Path::to_path_buf));
    covers.extend(closed.map(Path::to_path_buf));
    // A cover below another is hidden by it anyway; one at or below `dir` would hide it.
    let all = covers.clone();
    covers.retain(|c| !c.starts_with(dir) && !all.iter().any(|o| o != c && c.starts_with(o)));
    covers.sort();
    covers.dedup();
    let mut mkdirs = Vec::new();
    let mut binds = Vec::new();
    if let Some(holder) = covers.iter().find(|c| dir.starts_with(c)) {
        let mut down: Vec<PathBuf> = dir
            .ancestors()
            .take_while(|a| *a != holder.as_path())
            .map(Path::to_path_buf)
            .collect();
        down.reverse();
        mkdirs.extend(down);
        binds.push(Bind {
            from: dir.to_path_buf(),
            to: dir.to_path_buf(),
        });
    }
    // The scratch's parent is a cover, so only the scratch itself is made; it must not be one
    // of the directories made on the way down to `dir`.
    if mkdirs.iter().any(|m| m.starts_with(scratch)) {
        return Err(ConfineError::Path(dir.to_path_buf()));
    }
    mkdirs.push(scratch.to_path_buf());
    binds.push(Bind {
        from: dir.join(SCRATCH_SOURCE),
        to: scratch.to_path_buf(),
    });
    Ok(Plan {
        covers,
        mkdirs,
        binds,
    })
}

/// Everything the forked child needs, made before the fork (C strings only).
pub struct Prepared {
    covers: Vec<CString>,
    mkdirs: Vec<CString>,
    /// `(from, to)` of each bind, at most [`MAX_BINDS`].
    binds: Vec<(CString, CString)>,
}

/// `/proc/self/fd/<fd>` with a NUL, written into `buf` without allocating.
fn fd_path(fd: i32, buf: &mut [u8; 32]) -> *const libc::c_char {
    const PREFIX: &[u8] = b"/proc/self/fd/";
    buf[..PREFIX.len()].copy_from_slice(PREFIX);
    let mut digits = [0u8; 10];
    let (mut n, mut len) = (fd.unsigned_abs(), 0);
    loop {
        digits[len] = b'0' + (n % 10) as u8;
        len += 1;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    for i in 0..len {
        buf[PREFIX.len() + i] = digits[len - 1 - i];
    }
    buf[PREFIX.len() + len] = 0;
    buf.as_ptr().cast()
}

fn cstr(p: &Path) -> Result<CString, ConfineError> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| ConfineError::Nul(p.to_path_buf()))
}

fn cstrs(ps: &[PathBuf]) -> Result<Vec<CString>, ConfineError> {
    ps.iter().map(|p| cstr(p)).collect()
}

/// The directories of [`COVERED`] that exist here (links not followed).
fn present_covered() -> Vec<PathBuf> {
    COVERED
        .iter()
        .map(PathBuf::from)
        .filter(|p| std::fs::symlink_metadata(p).is_ok_and(|m| m.is_dir()))
        .collect()
}

impl Prepared {
    /// Confinement to `dir`, which must exist with its [`SCRATCH_SOURCE`] and has just been
    /// handed over to [`BROWSER_UID`]. Ancestors are examined now (an ancestor that cannot be
    /// examined counts as closed, and is covered); the bind sources are opened in the child,
    /// inside its new namespace, following no link at their last component.
    pub fn for_dir(dir: &Path) -> Result<Prepared, ConfineError> {
        let plan = plan(dir, &present_covered(), |a| {
            std::fs::symlink_metadata(a).is_ok_and(|m| {
                m.is_dir() && searchable(m.mode(), m.uid(), m.gid(), BROWSER_UID, BROWSER_GID)
            })
        })?;
        assert!(
            plan.binds.len() <= MAX_BINDS,
            "a plan has at most two binds"
        );
        Ok(Prepared {
            covers: cstrs(&plan.covers)?,
            mkdirs: cstrs(&plan.mkdirs)?,
            binds: plan
                .binds
                .iter()
                .map(|b| Ok((cstr(&b.from)?, cstr(&b.to)?)))
                .collect::<Result<_, ConfineError>>()?,
        })
    }

    /// No directory: only the namespaces, `/proc`, the covers of [`COVERED`] and the uid
    /// change (what a privilege probe needs).
    pub fn without_dir() -> Result<Prepared, ConfineError> {
        Ok(Prepared {
            covers: cstrs(&present_covered())?,
            mkdirs: Vec::new(),
            binds: Vec::new(),
        })
    }

    /// Runs in the forked child before exec: new network and mount namespaces, a `/proc` of
    /// its own that lists only its uid's processes, the covers, directories and binds of the
    /// plan, then [`BROWSER_UID`] with no groups and
    /// `no_new_privs`. Needs root (`CAP_SYS_ADMIN`, `CAP_SETUID`, `CAP_SETGID`).
    ///
    /// # Safety
    /// Only between fork and exec: it changes the calling process's namespaces and identity.
    /// It makes only async-signal-safe system calls and allocates nothing.
    pub unsafe fn enter(&self) -> io::Result<()> {
        let fail = || Err(io::Error::last_os_error());
        if libc::unshare(libc::CLONE_NEWNET | libc::CLONE_NEWNS) != 0 {
            return fail();
        }
        let none = std::ptr::null::<libc::c_char>();
        // Private first: the mounts below must not propagate to the host's namespace.
        if libc::mount(
            none,
            c"/".as_ptr(),
            none,
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        ) != 0
        {
            return fail();
        }
        // The bind sources are opened before the covers hide them, inside the new namespace:
        // a bind mount's source must be a mount of the caller's own namespace.
        let mut fds = [-1i32; MAX_BINDS];
        for ((from, _), fd) in self.binds.iter().zip(fds.iter_mut()) {
            *fd = libc::open(
                from.as_ptr(),
                libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            );
            if *fd < 0 {
                return fail();
            }
        }
        if libc::mount(
            c"proc".as_ptr(),
            c"/proc".as_ptr(),
            c"proc".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            c"hidepid=invisible".as_ptr().cast(),
        ) != 0
        {
            return fail();
        }
        for c in &self.covers {
            if libc::mount(
                c"tmpfs".as_ptr(),
                c.as_ptr(),
                c"tmpfs".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                COVER_DATA.as_ptr().cast(),
            ) != 0
            {
                return fail();
            }
        }
        for d in &self.mkdirs {
            if libc::mkdir(d.as_ptr(), 0o755) != 0 {
                return fail();
            }
        }
        let mut src = [0u8; 32];
        for ((_, to), fd) in self.binds.iter().zip(fds) {
            if libc::mount(
                fd_path(fd, &mut src),
                to.as_ptr(),
                none,
                libc::MS_BIND | libc::MS_REC,
                std::ptr::null(),
            ) != 0
            {
                return fail();
            }
            libc::close(fd);
        }
        let (uid, gid) = (BROWSER_UID as libc::c_long, BROWSER_GID as libc::c_long);
        let no_groups: [libc::gid_t; 0] = [];
        // Raw system calls: the C library's wrappers would signal threads this child lacks.
        if libc::syscall(libc::SYS_setgroups, 0 as libc::c_long, no_groups.as_ptr()) != 0
            || libc::syscall(libc::SYS_setresgid, gid, gid, gid) != 0
            || libc::syscall(libc::SYS_setresuid, uid, uid, uid) != 0
        {
            return fail();
        }
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
            return fail();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> PathBuf {
        PathBuf::from(s)
    }

    fn scratch_bind(dir: &Path) -> Bind {
        Bind {
            from: dir.join("tmp"),
            to: p(SCRATCH),
        }
    }

    #[test]
    fn fd_paths_are_written_without_allocating() {
        let mut buf = [0u8; 32];
        for (fd, want) in [
            (0, "/proc/self/fd/0"),
            (7, "/proc/self/fd/7"),
            (1234, "/proc/self/fd/1234"),
        ] {
            // SAFETY: `fd_path` wrote a NUL-terminated string into `buf`.
            let got = unsafe { std::ffi::CStr::from_ptr(fd_path(fd, &mut buf)) };
            assert_eq!(got.to_str().unwrap(), want);
        }
    }

    #[test]
    fn searchable_reads_the_bit_of_the_class_the_uid_falls_in() {
        assert!(searchable(0o711, 0, 0, 7, 7));
        assert!(!searchable(0o770, 0, 0, 7, 7));
        assert!(searchable(0o710, 0, 7, 7, 7));
        // The owner's bit decides for the owner, even when others may search.
        assert!(!searchable(0o601, 7, 0, 7, 7));
        assert!(searchable(0o700, 7, 0, 7, 7));
    }

    #[test]
    fn the_cover_is_the_highest_closed_ancestor_and_the_path_is_remade_under_it() {
        let dir = p("/srv/node/pool-x/w3/browser");
        let closed = ["/srv/node/pool-x", "/srv/node/pool-x/w3"];
        let mut asked = Vec::new();
        let plan = plan(&dir, &[p("/tmp"), p("/dev/shm")], |a| {
            asked.push(a.to_path_buf());
            !closed.iter().any(|c| Path::new(c) == a)
        })
        .unwrap();
        // Asked top down, stopping at the first closed one.
        assert_eq!(asked, [p("/srv"), p("/srv/node"), p("/srv/node/pool-x")]);
        assert_eq!(
            plan.covers,
            [p("/dev/shm"), p("/srv/node/pool-x"), p("/tmp")]
        );
        assert_eq!(
            plan.mkdirs,
            [
                p("/srv/node/pool-x/w3"),
                p("/srv/node/pool-x/w3/browser"),
                p(SCRATCH)
            ]
        );
        assert_eq!(
            plan.binds,
            [
                Bind {
                    from: dir.clone(),
                    to: dir.clone()
                },
                scratch_bind(&dir)
            ]
        );
    }

    #[test]
    fn a_world_writable_cover_above_the_closed_one_holds_the_path() {
        let dir = p("/tmp/.tmpA/pool/w0/browser");
        // The test's temp dir is already closed; the pool root below it too.
        let plan = plan(&dir, &[p("/tmp"), p("/var/tmp")], |a| {
            a == Path::new("/tmp")
        })
        .unwrap();
        assert_eq!(plan.covers, [p("/tmp"), p("/var/tmp")]);
        assert_eq!(
            plan.mkdirs,
            [
                p("/tmp/.tmpA"),
                p("/tmp/.tmpA/pool"),
                p("/tmp/.tmpA/pool/w0"),
                p("/tmp/.tmpA/pool/w0/browser"),
                p(SCRATCH)
            ]
        );
        assert_eq!(plan.binds.len(), 2);
        assert_eq!(plan.binds[1], scratch_bind(&dir));
    }

    #[test]
    fn an_open_path_binds_only_the_scratch_and_bad_paths_are_refused() {
        // Nothing of COVERED on this host: /tmp is covered all the same.
        let plan = plan(&p("/srv/b"), &[], |_| true).unwrap();
        assert_eq!(
            plan,
            Plan {
                covers: vec![p("/tmp")],
                mkdirs: vec![p(SCRATCH)],
                binds: vec![scratch_bind(&p("/srv/b"))],
            }
        );
        for bad in [
            "relative/b",
            "/srv/../etc/b",
            "/srv/./b",
            "/srv/b/",
            "/tmp/clawrl-browser/x",
            "/tmp",
        ] {
            assert!(matches!(plan_of(bad), Err(ConfineError::Path(_))), "{bad}");
        }
    }

    fn plan_of(s: &str) -> Result<Plan, ConfineError> {
        plan(Path::new(s), &[], |_| true)
    }
}
