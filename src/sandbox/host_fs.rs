//! Host-side file operations on work dirs, none of which follows a symbolic link: creating a
//! fresh private directory ([`private_dir`]), writing files and directories into a work dir
//! ([`write_file`], [`create_dirs`]) and handing a work dir's tree to the sandbox user
//! ([`hand_over`]).
//!
//! The host runs as root and a work dir's contents belong to the sandboxed command, which may
//! plant links anywhere in it. So every step below the directory a caller names is taken
//! relative to an open directory fd, with `O_NOFOLLOW` (or `AT_SYMLINK_NOFOLLOW`), never by
//! resolving a path again: a link is refused (writes) or treated as the link itself (chown),
//! and its target is never touched. The directory a caller names is opened with `O_NOFOLLOW`
//! too; only its ancestors are resolved normally, which is safe because they are the
//! operator's (a data dir, the temp dir) and [`private_dir`] creates the work dirs' root fresh,
//! mode 0700, in a parent that only its owner (or root) can rename entries of.

use std::ffi::{CStr, CString, OsStr};
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Component, Path, PathBuf};

fn cstr(s: &OsStr) -> io::Result<CString> {
    CString::new(s.as_bytes()).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{s:?} contains a NUL byte"),
        )
    })
}

fn check(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// Opens the directory `path` itself (its last component must not be a link).
fn open_dir(path: &Path) -> io::Result<OwnedFd> {
    let p = cstr(path.as_os_str())?;
    // SAFETY: `p` is a valid C string; the returned fd is owned by nobody else.
    let fd = check(unsafe {
        libc::open(
            p.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    })?;
    // SAFETY: `fd` was just opened and is owned here only.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Opens the directory `name` of `dir`; a link there fails (`ELOOP` / `ENOTDIR`).
fn open_dir_at(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<OwnedFd> {
    // SAFETY: `dir` is an open fd and `name` a valid C string.
    let fd = check(unsafe {
        libc::openat(
            dir.as_raw_fd(),
            name.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    })?;
    // SAFETY: `fd` was just opened and is owned here only.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `fstatat(dir, name, AT_SYMLINK_NOFOLLOW)`: a link is described, not its target.
fn lstat_at(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<libc::stat> {
    // SAFETY: `st` is plain data that fstatat fills; `dir` is open, `name` a C string.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        check(libc::fstatat(
            dir.as_raw_fd(),
            name.as_ptr(),
            &mut st,
            libc::AT_SYMLINK_NOFOLLOW,
        ))?;
        Ok(st)
    }
}

fn fstat(fd: BorrowedFd<'_>) -> io::Result<libc::stat> {
    // SAFETY: `st` is plain data that fstat fills; `fd` is open.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        check(libc::fstat(fd.as_raw_fd(), &mut st))?;
        Ok(st)
    }
}

fn is_dir(st: &libc::stat) -> bool {
    st.st_mode & libc::S_IFMT == libc::S_IFDIR
}

/// The names in an open directory, without `.` and `..`.
fn entries(dir: BorrowedFd<'_>) -> io::Result<Vec<CString>> {
    // fdopendir owns the fd it is given, so it gets a duplicate; the duplicate shares the file
    // offset with `dir`, hence the rewind.
    // SAFETY: `dir` is open; F_DUPFD_CLOEXEC returns a new fd that we own.
    let dup = check(unsafe { libc::fcntl(dir.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) })?;
    // SAFETY: `dup` is an open directory fd that fdopendir takes over on success.
    let stream = unsafe { libc::fdopendir(dup) };
    if stream.is_null() {
        let e = io::Error::last_os_error();
        // SAFETY: fdopendir failed, so `dup` is still ours to close.
        unsafe { libc::close(dup) };
        return Err(e);
    }
    let mut names = Vec::new();
    let result = loop {
        // SAFETY: `stream` is a valid DIR*; readdir reports errors through errno only, so errno
        // is cleared first; the entry it returns is valid until the next readdir call.
        unsafe {
            *libc::__errno_location() = 0;
            let ent = libc::readdir(stream);
            if ent.is_null() {
                let e = io::Error::last_os_error();
                break match e.raw_os_error() {
                    Some(0) | None => Ok(()),
                    Some(_) => Err(e),
                };
            }
            let name = CStr::from_ptr((*ent).d_name.as_ptr());
            if name.to_bytes() != b"." && name.to_bytes() != b".." {
                names.push(name.to_owned());
            }
        }
    };
    // SAFETY: `stream` is valid and closed exactly once (which closes `dup`).
    unsafe { libc::closedir(stream) };
    result.map(|()| names)
}

fn ctx(e: io::Error, what: impl std::fmt::Display) -> io::Error {
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// Hands the directory `dir` and everything in it to `uid:gid` (the sandbox user), never
/// following a link: each entry is examined with `fstatat(AT_SYMLINK_NOFOLLOW)`, changed with
/// `fchownat(AT_SYMLINK_NOFOLLOW)` (a link gets the new owner, its target does not) and only
/// real directories are descended into, opened `O_NOFOLLOW` relative to their parent's fd.
/// Entries already owned by `uid:gid` are left alone. An entry that vanishes meanwhile is
/// skipped.
pub fn hand_over(dir: &Path, uid: u32, gid: u32) -> io::Result<()> {
    let root = open_dir(dir).map_err(|e| ctx(e, format!("opening {}", dir.display())))?;
    let st = fstat(root.as_fd()).map_err(|e| ctx(e, format!("stat {}", dir.display())))?;
    if st.st_uid != uid || st.st_gid != gid {
        // SAFETY: `root` is an open fd.
        check(unsafe { libc::fchown(root.as_raw_fd(), uid, gid) })
            .map_err(|e| ctx(e, format!("chown {}", dir.display())))?;
    }
    let names = entries(root.as_fd()).map_err(|e| ctx(e, format!("read dir {}", dir.display())))?;
    // Depth-first with one open fd per level: (the directory, its path for messages, the names
    // not yet visited).
    let mut stack: Vec<(OwnedFd, PathBuf, Vec<CString>)> = vec![(root, dir.to_path_buf(), names)];
    while let Some((fd, path, names)) = stack.last_mut() {
        let Some(name) = names.pop() else {
            stack.pop();
            continue;
        };
        let child = path.join(OsStr::from_bytes(name.to_bytes()));
        let dirfd = fd.as_fd();
        let st = match lstat_at(dirfd, &name) {
            Ok(st) => st,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(ctx(e, format!("stat {}", child.display()))),
        };
        if st.st_uid != uid || st.st_gid != gid {
            // SAFETY: `dirfd` is open and `name` a C string; AT_SYMLINK_NOFOLLOW changes a
            // link itself.
            let rc = unsafe {
                libc::fchownat(
                    dirfd.as_raw_fd(),
                    name.as_ptr(),
                    uid,
                    gid,
                    libc::AT_SYMLINK_NOFOLLOW,
                )
            };
            match check(rc) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(ctx(e, format!("chown {}", child.display()))),
            }
        }
        if is_dir(&st) {
            let sub = match open_dir_at(dirfd, &name) {
                Ok(f) => f,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(ctx(e, format!("opening {}", child.display()))),
            };
            let names = entries(sub.as_fd())
                .map_err(|e| ctx(e, format!("read dir {}", child.display())))?;
            stack.push((sub, child, names));
        }
    }
    Ok(())
}

/// The normal components of a relative path; anything else (absolute, `..`, `.`, empty) is
/// refused, so that a walk from a directory fd stays below it.
fn normal_components(rel: &Path) -> io::Result<Vec<CString>> {
    let bad = || {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} is not a plain relative path (no `..`, `.` or leading `/`)",
                rel.display()
            ),
        )
    };
    let mut out = Vec::new();
    for c in rel.components() {
        match c {
            Component::Normal(s) => out.push(cstr(s)?),
            _ => return Err(bad()),
        }
    }
    if out.is_empty() {
        return Err(bad());
    }
    Ok(out)
}

/// `mkdirat(dir, name, 0755)` unless it exists, then opens it `O_NOFOLLOW` (so an existing link
/// or file there is an error).
fn mkdir_open_at(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<OwnedFd> {
    // SAFETY: `dir` is open and `name` a C string.
    match check(unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), 0o755) }) {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    open_dir_at(dir, name)
}

/// Opens `root` and then every directory of `dirs` below it, creating the missing ones.
fn walk_dirs(root: &Path, dirs: &[CString]) -> io::Result<OwnedFd> {
    let mut fd = open_dir(root).map_err(|e| ctx(e, format!("opening {}", root.display())))?;
    for (i, d) in dirs.iter().enumerate() {
        fd = mkdir_open_at(fd.as_fd(), d).map_err(|e| {
            let so_far: PathBuf = dirs[..=i]
                .iter()
                .map(|c| OsStr::from_bytes(c.to_bytes()))
                .collect();
            ctx(
                e,
                format!("directory {} (a link is never followed)", so_far.display()),
            )
        })?;
    }
    Ok(fd)
}

/// Creates the directory `rel` (and its missing parents, mode 0755) under the directory `root`,
/// following no link: an existing link on the way is an error.
pub fn create_dirs(root: &Path, rel: &Path) -> io::Result<()> {
    let comps = normal_components(rel)?;
    walk_dirs(root, &comps).map(drop)
}

/// Writes a new file `rel` (with its missing parent directories) under the directory `root`,
/// with permission bits `mode` exactly (the umask does not apply), following no link: the file
/// is created `O_CREAT | O_EXCL | O_NOFOLLOW` relative to its parent's fd, so an existing entry
/// at `rel` (a link above all) or a link on the way is an error and nothing outside `root` is
/// written.
pub fn write_file(root: &Path, rel: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    let mut comps = normal_components(rel)?;
    let name = comps.pop().expect("at least one component");
    let dir = walk_dirs(root, &comps)?;
    // SAFETY: `dir` is open and `name` a C string; the new fd is owned here only.
    let fd = check(unsafe {
        libc::openat(
            dir.as_raw_fd(),
            name.as_ptr(),
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            mode,
        )
    })
    .map_err(|e| ctx(e, format!("creating {}", rel.display())))?;
    // SAFETY: `fd` was just opened and is owned here only.
    let mut file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    // SAFETY: `file` is an open fd.
    check(unsafe { libc::fchmod(file.as_raw_fd(), mode) })
        .map_err(|e| ctx(e, format!("chmod {}", rel.display())))?;
    file.write_all(bytes)
        .map_err(|e| ctx(e, format!("writing {}", rel.display())))
}

/// Whether a directory with this owner and mode lets only its owner (this process's user, or
/// root) rename or replace its entries: owned by one of them, and either writable by its owner
/// alone or sticky (as `/tmp` is).
fn parent_is_safe(uid: u32, mode: u32, me: u32) -> bool {
    (uid == me || uid == 0) && (mode & 0o022 == 0 || mode & libc::S_ISVTX != 0)
}

/// Creates a fresh directory `<parent>/<prefix><16 random hex digits>`, mode 0700, owned by
/// this process's user, and returns its path. `parent` is created first when missing, and must
/// be a directory where nobody else can rename entries (owned by this user or root, and not
/// writable by others unless sticky), so the new directory cannot be swapped for a link later.
/// The name is new: `mkdir` fails on anything that exists (a link included), and then another
/// name is drawn; a directory someone made beforehand is never used. Its owner and mode are
/// checked through an fd opened `O_NOFOLLOW` on it.
pub fn private_dir(parent: &Path, prefix: &str) -> io::Result<PathBuf> {
    std::fs::create_dir_all(parent)
        .map_err(|e| ctx(e, format!("creating {}", parent.display())))?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let pm = std::fs::metadata(parent).map_err(|e| ctx(e, format!("stat {}", parent.display())))?;
    if !pm.is_dir() || !parent_is_safe(pm.uid(), pm.mode(), me) {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{} (owner {}, mode {:o}) must be a directory owned by uid {me} or root and not \
                 writable by others unless sticky",
                parent.display(),
                pm.uid(),
                pm.mode() & 0o7777
            ),
        ));
    }
    for _ in 0..64 {
        let path = parent.join(format!("{prefix}{:016x}", rand::random::<u64>()));
        match std::fs::DirBuilder::new().mode(0o700).create(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(ctx(e, format!("creating {}", path.display()))),
        }
        let fd = open_dir(&path).map_err(|e| ctx(e, format!("opening {}", path.display())))?;
        // The umask may have taken bits off 0700; set it exactly.
        // SAFETY: `fd` is open.
        check(unsafe { libc::fchmod(fd.as_raw_fd(), 0o700) })
            .map_err(|e| ctx(e, format!("chmod {}", path.display())))?;
        let st = fstat(fd.as_fd()).map_err(|e| ctx(e, format!("stat {}", path.display())))?;
        if st.st_uid != me || st.st_mode & 0o7777 != 0o700 || !is_dir(&st) {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "{} is not a directory of uid {me} with mode 700 right after creating it",
                    path.display()
                ),
            ));
        }
        return Ok(path);
    }
    Err(io::Error::new(
        io::ErrorKind::AlreadyExists,
        format!("no fresh name under {} after 64 tries", parent.display()),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{symlink, PermissionsExt};

    fn is_root() -> bool {
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() == 0 }
    }

    #[test]
    fn parent_safety_rule() {
        assert!(parent_is_safe(0, 0o40755, 0));
        assert!(parent_is_safe(0, 0o41777, 1000)); // /tmp: root's, sticky
        assert!(parent_is_safe(1000, 0o40700, 1000));
        assert!(!parent_is_safe(1000, 0o40777, 0)); // someone else's, world-writable
        assert!(!parent_is_safe(0, 0o40777, 0)); // world-writable without sticky
        assert!(!parent_is_safe(0, 0o40775, 0)); // group-writable
        assert!(!parent_is_safe(1234, 0o40755, 0)); // another user could rename entries
    }

    #[test]
    fn private_dirs_are_fresh_0700_and_never_a_planted_one() {
        let parent = tempfile::tempdir().unwrap();
        let a = private_dir(parent.path(), "p-").unwrap();
        let b = private_dir(parent.path(), "p-").unwrap();
        assert_ne!(a, b);
        for d in [&a, &b] {
            let m = std::fs::symlink_metadata(d).unwrap();
            assert!(m.is_dir());
            assert_eq!(m.permissions().mode() & 0o7777, 0o700);
            assert!(d.file_name().unwrap().to_str().unwrap().starts_with("p-"));
        }
        // A world-writable parent without the sticky bit is refused.
        let open = parent.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = private_dir(&open, "p-").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
    }

    #[test]
    fn writes_never_follow_a_planted_link() {
        let dir = tempfile::tempdir().unwrap();
        let wd = dir.path().join("wd");
        std::fs::create_dir(&wd).unwrap();
        let outside = dir.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        let host_file = dir.path().join("host-file");
        std::fs::write(&host_file, "keep").unwrap();
        symlink(&host_file, wd.join("f")).unwrap();
        symlink(&outside, wd.join("d")).unwrap();

        // A link at the file's own name: refused, the target keeps its bytes.
        assert!(write_file(&wd, Path::new("f"), b"evil", 0o644).is_err());
        assert_eq!(std::fs::read_to_string(&host_file).unwrap(), "keep");
        // A link on the way: refused, nothing is created in its target.
        assert!(write_file(&wd, Path::new("d/x"), b"evil", 0o644).is_err());
        assert!(create_dirs(&wd, Path::new("d/sub")).is_err());
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
        // Paths that would leave the dir are refused before any IO.
        for bad in ["../x", "/etc/x", "a/../../x", ""] {
            let e = write_file(&wd, Path::new(bad), b"x", 0o644).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{bad}: {e}");
        }
        // The work dir itself being a link is refused too.
        let wd_link = dir.path().join("wd-link");
        symlink(&outside, &wd_link).unwrap();
        assert!(write_file(&wd_link, Path::new("x"), b"x", 0o644).is_err());
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);

        // Ordinary writes work, with exact modes and parents created.
        write_file(&wd, Path::new("a/b/run.sh"), b"#!/bin/sh\n", 0o755).unwrap();
        write_file(&wd, Path::new("a/c.txt"), b"c", 0o644).unwrap();
        create_dirs(&wd, Path::new("a/empty/deeper")).unwrap();
        let m = std::fs::metadata(wd.join("a/b/run.sh")).unwrap();
        assert_eq!(m.permissions().mode() & 0o777, 0o755);
        assert_eq!(
            std::fs::metadata(wd.join("a/c.txt"))
                .unwrap()
                .permissions()
                .mode()
                & 0o777,
            0o644
        );
        assert!(wd.join("a/empty/deeper").is_dir());
        // A second write of the same file is refused (work dirs start empty).
        assert!(write_file(&wd, Path::new("a/c.txt"), b"again", 0o644).is_err());
    }

    #[test]
    fn hand_over_changes_links_not_their_targets() {
        if !is_root() {
            eprintln!("skipped: chown needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let wd = dir.path().join("wd");
        std::fs::create_dir_all(wd.join("sub/deep")).unwrap();
        std::fs::write(wd.join("sub/deep/f"), "x").unwrap();
        let host_file = dir.path().join("host-file");
        std::fs::write(&host_file, "keep").unwrap();
        let host_dir = dir.path().join("host-dir");
        std::fs::create_dir(&host_dir).unwrap();
        std::fs::write(host_dir.join("inner"), "keep").unwrap();
        symlink(&host_file, wd.join("link-to-file")).unwrap();
        symlink(&host_dir, wd.join("sub/link-to-dir")).unwrap();

        hand_over(&wd, 4242, 4343).unwrap();

        for p in [
            wd.clone(),
            wd.join("sub"),
            wd.join("sub/deep"),
            wd.join("sub/deep/f"),
            wd.join("link-to-file"),
            wd.join("sub/link-to-dir"),
        ] {
            let m = std::fs::symlink_metadata(&p).unwrap();
            assert_eq!((m.uid(), m.gid()), (4242, 4343), "{}", p.display());
        }
        for p in [&host_file, &host_dir, &host_dir.join("inner")] {
            let m = std::fs::symlink_metadata(p).unwrap();
            assert_eq!(
                (m.uid(), m.gid()),
                (0, 0),
                "{} was handed over",
                p.display()
            );
        }
        // Idempotent, and a link as the work dir itself is refused.
        hand_over(&wd, 4242, 4343).unwrap();
        let wd_link = dir.path().join("wd-link");
        symlink(&host_dir, &wd_link).unwrap();
        assert!(hand_over(&wd_link, 4242, 4343).is_err());
        assert_eq!(std::fs::symlink_metadata(&host_dir).unwrap().uid(), 0);
    }
}
