//! Size-capped work dirs: a tmpfs of a fixed size mounted (on the host) over a fresh, empty
//! work dir. Everything written there, by the host or by any number of sandboxed commands, in
//! any number of files, counts against one total, and a write past it fails with `ENOSPC`;
//! the host disk is never touched. The host still reads and writes the dir at its own path
//! between commands, and each sandbox sees it at `/work` (the sandbox's bind of the work dir is
//! recursive, so it shows the tmpfs mounted there).
//!
//! The contents live in memory (swappable). Pages a sandboxed command writes are charged to
//! that sandbox's memory cgroup while it runs, like those of its `/tmp`.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Why mounting or unmounting a capped work dir failed.
#[derive(Debug, thiserror::Error)]
pub enum ScratchError {
    /// The tmpfs could not be mounted (e.g. `EPERM` without `CAP_SYS_ADMIN`).
    #[error("mounting a {size_mb} MiB tmpfs on {dir}: {source}")]
    Mount {
        dir: PathBuf,
        size_mb: u64,
        #[source]
        source: io::Error,
    },
    /// The tmpfs could not be unmounted.
    #[error("unmounting the tmpfs on {dir}: {source}")]
    Unmount {
        dir: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The size or the path cannot be used.
    #[error("capped work dir {dir}: {reason}")]
    Invalid { dir: PathBuf, reason: String },
}

fn cpath(dir: &Path) -> Result<CString, ScratchError> {
    CString::new(dir.as_os_str().as_bytes()).map_err(|_| ScratchError::Invalid {
        dir: dir.to_path_buf(),
        reason: "the path contains a NUL byte".into(),
    })
}

/// The tmpfs mount data for a cap of `size_mb` MiB: private to its owner (the work dir is
/// handed to the sandbox user before each command).
fn mount_data(size_mb: u64) -> String {
    format!("size={size_mb}m,mode=0700")
}

/// Mounts a `size_mb` MiB tmpfs (`nosuid,nodev`) on the existing directory `dir`, which the
/// caller created and which nobody else can replace (a link there would be followed).
pub fn mount_capped(dir: &Path, size_mb: u64) -> Result<(), ScratchError> {
    if size_mb == 0 || size_mb > (1 << 30) {
        return Err(ScratchError::Invalid {
            dir: dir.to_path_buf(),
            reason: format!("size {size_mb} MiB is not in 1..=2^30"),
        });
    }
    let target = cpath(dir)?;
    let data = CString::new(mount_data(size_mb)).expect("no NUL in the mount data");
    // SAFETY: every pointer is a valid C string that outlives the call.
    let rc = unsafe {
        libc::mount(
            c"tmpfs".as_ptr(),
            target.as_ptr(),
            c"tmpfs".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            data.as_ptr().cast(),
        )
    };
    if rc != 0 {
        return Err(ScratchError::Mount {
            dir: dir.to_path_buf(),
            size_mb,
            source: io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Unmounts the tmpfs on `dir` (lazily: a process still inside keeps it until it leaves), never
/// following a link at `dir`. Its contents are gone with it.
pub fn unmount(dir: &Path) -> Result<(), ScratchError> {
    let target = cpath(dir)?;
    // SAFETY: `target` is a valid C string.
    let rc = unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH | libc::UMOUNT_NOFOLLOW) };
    if rc != 0 {
        return Err(ScratchError::Unmount {
            dir: dir.to_path_buf(),
            source: io::Error::last_os_error(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mount_data_caps_the_total_and_keeps_the_dir_private() {
        assert_eq!(mount_data(64), "size=64m,mode=0700");
        let d = Path::new("/nonexistent/clawrl");
        assert!(matches!(
            mount_capped(d, 0),
            Err(ScratchError::Invalid { .. })
        ));
    }
}
