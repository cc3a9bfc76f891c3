//! Host work dirs for episodes: a pool of empty directories created ahead of time under one
//! root, handed out one per episode and removed (then replaced in the pool) when it closes.
//!
//! The root is created fresh by the pool ([`crate::sandbox::host_fs::private_dir`]: a new random
//! name, mode 0700, owned by this process), never a directory that existed before, because
//! what is under it is chowned and bind-mounted by root; and only root can add, rename or
//! replace entries in it, so a work dir's path stays the directory the pool made.
//!
//! With a cap, each work dir is a tmpfs of that size mounted over the fresh directory
//! ([`crate::sandbox::scratch`]): whatever an episode writes there, in any number of files,
//! counts against one total (`ENOSPC` past it) and never reaches the host disk. Where the
//! mount is refused (no `CAP_SYS_ADMIN`), a warning is logged once and the dirs are plain
//! directories, bounded only per file by the sandbox's `RLIMIT_FSIZE`.
//!
//! Removal never follows symbolic links a policy may have planted (`std::fs::remove_dir_all`
//! removes the link, not its target; a capped dir is unmounted, which takes its contents). A
//! [`WorkDir`] dropped without [`WorkDir::remove`] is removed synchronously in `Drop`, so a
//! panicking episode leaks nothing.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::sandbox::scratch;

/// A pool of empty work dirs under one root.
#[derive(Debug)]
pub struct WorkDirPool {
    root: PathBuf,
    warm: usize,
    /// The size of each dir's tmpfs in MiB (`None`: plain directories).
    cap_mb: Option<u64>,
    /// Set once a mount was refused: the dirs are plain from then on.
    uncapped: AtomicBool,
    ready: Mutex<Vec<Made>>,
    counter: AtomicU64,
}

/// A dir the pool made, and whether a capped tmpfs is mounted on it.
#[derive(Debug)]
struct Made {
    path: PathBuf,
    mounted: bool,
}

impl WorkDirPool {
    /// Creates a fresh root `<parent>/<prefix><random>` (mode 0700; `parent` is created when
    /// missing and must be safe, see [`crate::sandbox::host_fs::private_dir`]) and `warm` empty
    /// dirs in it, each a tmpfs of `cap_mb` MiB when given.
    pub fn new(
        parent: &Path,
        prefix: &str,
        warm: usize,
        cap_mb: Option<u64>,
    ) -> io::Result<Arc<Self>> {
        let root = crate::sandbox::host_fs::private_dir(parent, prefix)?;
        let pool = Arc::new(Self {
            root,
            warm,
            cap_mb,
            uncapped: AtomicBool::new(false),
            ready: Mutex::new(Vec::with_capacity(warm)),
            counter: AtomicU64::new(0),
        });
        for _ in 0..warm {
            let d = pool.create()?;
            pool.ready.lock().expect("pool lock").push(d);
        }
        Ok(pool)
    }

    /// The root the dirs live under.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// How many dirs are ready now.
    pub fn ready(&self) -> usize {
        self.ready.lock().expect("pool lock").len()
    }

    /// Whether the dirs are capped (a cap was asked for and no mount has been refused).
    pub fn capped(&self) -> bool {
        self.cap_mb.is_some() && !self.uncapped.load(Ordering::Relaxed)
    }

    fn create(&self) -> io::Result<Made> {
        let path = loop {
            let n = self.counter.fetch_add(1, Ordering::Relaxed);
            let p = self.root.join(format!("w{n}"));
            match std::fs::create_dir(&p) {
                Ok(()) => break p,
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        };
        let Some(cap) = self.cap_mb.filter(|_| self.capped()) else {
            return Ok(Made {
                path,
                mounted: false,
            });
        };
        // The root is this pool's (mode 0700, made fresh), so the new dir cannot have been
        // swapped for a link before the mount.
        match scratch::mount_capped(&path, cap) {
            Ok(()) => Ok(Made {
                path,
                mounted: true,
            }),
            Err(e) => {
                if !self.uncapped.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "work dirs are not size-capped ({e}); only RLIMIT_FSIZE bounds each file"
                    );
                }
                Ok(Made {
                    path,
                    mounted: false,
                })
            }
        }
    }

    /// An empty work dir: one from the pool when there is one, else a new one.
    pub fn take(self: &Arc<Self>) -> io::Result<WorkDir> {
        let ready = self.ready.lock().expect("pool lock").pop();
        let made = match ready {
            Some(m) => m,
            None => self.create()?,
        };
        Ok(WorkDir {
            path: Some(made.path),
            mounted: made.mounted,
            pool: Arc::clone(self),
        })
    }

    fn refill(&self) {
        if self.ready() >= self.warm {
            return;
        }
        if let Ok(m) = self.create() {
            self.ready.lock().expect("pool lock").push(m);
        }
    }
}

impl Drop for WorkDirPool {
    fn drop(&mut self) {
        for m in self.ready.get_mut().expect("pool lock").drain(..) {
            let _ = remove_tree(&m.path, m.mounted);
        }
        // Removes the root only when no work dir is left in it.
        let _ = std::fs::remove_dir(&self.root);
    }
}

/// One episode's work dir; removed by [`WorkDir::remove`] or, failing that, on drop.
#[derive(Debug)]
pub struct WorkDir {
    path: Option<PathBuf>,
    /// A capped tmpfs is mounted on it.
    mounted: bool,
    pool: Arc<WorkDirPool>,
}

impl WorkDir {
    /// The host path (mounted at `/work` inside the sandbox).
    pub fn path(&self) -> &Path {
        self.path.as_deref().expect("present until removed")
    }

    /// Removes the dir and everything in it on a blocking thread, then tops the pool up.
    pub async fn remove(mut self) -> io::Result<()> {
        let path = self.path.take().expect("present until removed");
        let pool = Arc::clone(&self.pool);
        let mounted = self.mounted;
        tokio::task::spawn_blocking(move || {
            let r = remove_tree(&path, mounted);
            pool.refill();
            r
        })
        .await
        .unwrap_or_else(|e| Err(io::Error::other(e.to_string())))
    }
}

/// Removes an episode's work dir, if it still has one, when the episode closes; a failure is
/// logged (closing cannot fail) and the dir is then removed on drop as far as it can be.
pub async fn release(workdir: Option<WorkDir>) {
    if let Some(wd) = workdir {
        if let Err(e) = wd.remove().await {
            tracing::warn!("removing an episode's work dir: {e}");
        }
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if let Some(p) = self.path.take() {
            let _ = remove_tree(&p, self.mounted);
        }
    }
}

/// Removes a work dir: unmounts its tmpfs first when `mounted` (which takes the contents).
fn remove_tree(path: &Path, mounted: bool) -> io::Result<()> {
    if mounted {
        match scratch::unmount(path) {
            Ok(()) => {}
            // EINVAL: no longer a mount point (unmounted already); the dir is removed below.
            Err(scratch::ScratchError::Unmount { source, .. })
                if source.raw_os_error() == Some(libc::EINVAL) => {}
            Err(e) => return Err(io::Error::other(e)),
        }
    }
    match std::fs::remove_dir_all(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn pool_hands_out_fresh_dirs_and_refills_on_remove() {
        let parent = tempfile::tempdir().unwrap();
        let pool = WorkDirPool::new(parent.path(), "pool-", 2, None).unwrap();
        let root = pool.root().to_path_buf();
        assert_eq!(root.parent(), Some(parent.path()));
        assert_eq!(pool.ready(), 2);
        let a = pool.take().unwrap();
        let b = pool.take().unwrap();
        let c = pool.take().unwrap();
        assert_eq!(pool.ready(), 0);
        assert_ne!(a.path(), b.path());
        assert_ne!(b.path(), c.path());
        std::fs::write(a.path().join("f"), "x").unwrap();
        std::fs::create_dir(a.path().join("d")).unwrap();
        // A link out of the dir is removed, its target is not.
        let outside = parent.path().join("outside-target");
        std::fs::write(&outside, "keep").unwrap();
        std::os::unix::fs::symlink(&outside, a.path().join("link")).unwrap();
        let pa = a.path().to_path_buf();
        a.remove().await.unwrap();
        assert!(!pa.exists());
        assert_eq!(std::fs::read_to_string(&outside).unwrap(), "keep");
        assert_eq!(pool.ready(), 1);
        let pc = c.path().to_path_buf();
        drop(c);
        assert!(!pc.exists());
        b.remove().await.unwrap();
        std::fs::remove_file(&outside).unwrap();
        drop(pool);
        assert!(!root.exists());
    }

    #[test]
    fn the_root_is_new_private_and_never_a_planted_one() {
        use std::os::unix::fs::PermissionsExt;
        let parent = tempfile::tempdir().unwrap();
        // Whatever someone planted beside it is neither used nor touched.
        let victim = parent.path().join("victim");
        std::fs::create_dir(&victim).unwrap();
        std::os::unix::fs::symlink(&victim, parent.path().join("pool-planted")).unwrap();
        let a = WorkDirPool::new(parent.path(), "pool-", 1, None).unwrap();
        let b = WorkDirPool::new(parent.path(), "pool-", 1, None).unwrap();
        assert_ne!(a.root(), b.root());
        for p in [&a, &b] {
            let m = std::fs::symlink_metadata(p.root()).unwrap();
            assert!(m.is_dir());
            assert_eq!(m.permissions().mode() & 0o7777, 0o700);
        }
        assert_eq!(std::fs::read_dir(&victim).unwrap().count(), 0);
    }
}
