//! Per-sandbox cgroups: a memory limit that counts the memory a sandbox uses (resident pages,
//! page cache, the pages of its tmpfs mounts) rather than the address space its processes
//! reserve, and a limit on its processes and threads. Each sandbox gets its own cgroup,
//! created before the clone, joined by the sandbox init before it does anything, and removed
//! once the init has been reaped (anything still in it is killed first).
//!
//! Which hierarchy ([`mode`], decided once per process by creating a probe cgroup):
//!
//! - cgroup v2 where this process's v2 cgroup can hand `memory` and `pids` to its children
//!   (they are in its `cgroup.subtree_control`, or writing them there succeeds: the kernel
//!   refuses that while the cgroup itself holds processes, unless it is the root);
//! - else the v1 `memory` and `pids` hierarchies, when both are mounted and writable;
//! - else none: a warning is logged once and the sandbox keeps its rlimits alone
//!   (`RLIMIT_AS` for memory, `RLIMIT_NPROC` for processes).
//!
//! Sandbox cgroups are made below this process's own cgroup in each hierarchy, so the limits
//! the host itself runs under still enclose them. They are named `clawrl-sandbox-<pid>-<n>`
//! after the host process; one left behind by a host process that died before removing it
//! (SIGKILL) is removed by the next host process that decides the mode here, once empty. `CLAWRL_SANDBOX_CGROUPS=off` forces the
//! rlimit-only mode (as on a host that delegates nothing).
//!
//! The few files involved are written by hand: a crate such as `cgroups-rs` models every
//! controller of both versions, which is far more than the four files a sandbox needs, and its
//! hierarchy detection would still have to be wrapped in the fallback rule above.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Why a cgroup operation failed.
#[derive(Debug, thiserror::Error)]
pub(super) enum CgroupError {
    #[error("creating cgroup {dir}: {source}")]
    Create {
        dir: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("writing {value:?} to {file}: {source}")]
    Write {
        file: PathBuf,
        value: String,
        #[source]
        source: io::Error,
    },
    #[error("removing cgroup {dir}: {source}")]
    Remove {
        dir: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// Where this process sits in the cgroup hierarchies the host has mounted.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Offer {
    /// This process's cgroup v2 directory, when a cgroup2 file system is mounted.
    pub v2: Option<PathBuf>,
    /// This process's cgroup directory in the v1 `memory` hierarchy, when mounted.
    pub v1_memory: Option<PathBuf>,
    /// This process's cgroup directory in the v1 `pids` hierarchy, when mounted.
    pub v1_pids: Option<PathBuf>,
}

/// How sandboxes are limited on this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Mode {
    /// Each sandbox is a child of this cgroup v2 directory.
    V2 { parent: PathBuf },
    /// Each sandbox is a child of these v1 `memory` and `pids` directories.
    V1 { memory: PathBuf, pids: PathBuf },
    /// No usable cgroups (the reason): the rlimits alone.
    Off(String),
}

impl Mode {
    /// Whether a sandbox's memory is limited by its cgroup (so `RLIMIT_AS` is not needed).
    pub(super) fn limits_memory(&self) -> bool {
        !matches!(self, Mode::Off(_))
    }
}

/// Decodes the octal escapes (`\040` for a space) of a `/proc/self/mountinfo` field.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(u8::is_ascii_digit) {
            let v = (b[i + 1] - b'0') as u32 * 64
                + (b[i + 2] - b'0') as u32 * 8
                + (b[i + 3] - b'0') as u32;
            if let Ok(c) = u8::try_from(v) {
                out.push(c);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The directory of the cgroup `ours` in a hierarchy mounted at `mount_point` whose mount
/// shows the hierarchy from `root`; `None` when `ours` is outside what the mount shows.
fn resolve(root: &str, mount_point: &str, ours: &str) -> Option<PathBuf> {
    let rel = if root == "/" {
        ours
    } else {
        ours.strip_prefix(root)
            .filter(|r| r.is_empty() || r.starts_with('/'))?
    };
    let mut p = PathBuf::from(mount_point);
    for c in rel.split('/').filter(|c| !c.is_empty()) {
        if c == ".." || c == "." {
            return None;
        }
        p.push(c);
    }
    Some(p)
}

/// Reads where this process sits from the texts of `/proc/self/cgroup` (`id:controllers:path`
/// lines; `0::path` is the v2 one) and `/proc/self/mountinfo` (the first mount of each
/// hierarchy that shows this process's cgroup wins).
pub(super) fn offer(proc_cgroup: &str, mountinfo: &str) -> Offer {
    let mut v2_path = None;
    let mut v1: Vec<(Vec<&str>, &str)> = Vec::new();
    for line in proc_cgroup.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(id), Some(ctrls), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        if id == "0" && ctrls.is_empty() {
            v2_path = Some(path);
        } else {
            v1.push((ctrls.split(',').collect(), path));
        }
    }
    let mut offer = Offer::default();
    for line in mountinfo.lines() {
        let Some((pre, post)) = line.split_once(" - ") else {
            continue;
        };
        let pre: Vec<&str> = pre.split(' ').collect();
        let post: Vec<&str> = post.split(' ').collect();
        if pre.len() < 5 || post.is_empty() {
            continue;
        }
        let (root, mount_point) = (unescape(pre[3]), unescape(pre[4]));
        match post[0] {
            "cgroup2" => {
                if let (None, Some(ours)) = (&offer.v2, v2_path) {
                    offer.v2 = resolve(&root, &mount_point, ours);
                }
            }
            "cgroup" => {
                let opts: Vec<&str> = post
                    .get(2)
                    .map(|o| o.split(',').collect())
                    .unwrap_or_default();
                for (name, slot) in [
                    ("memory", &mut offer.v1_memory),
                    ("pids", &mut offer.v1_pids),
                ] {
                    if slot.is_some() || !opts.contains(&name) {
                        continue;
                    }
                    if let Some((_, ours)) = v1.iter().find(|(c, _)| c.contains(&name)) {
                        *slot = resolve(&root, &mount_point, ours);
                    }
                }
            }
            _ => {}
        }
    }
    offer
}

/// Whether a space-separated controller list (`cgroup.controllers`,
/// `cgroup.subtree_control`) names both `memory` and `pids`.
fn has_memory_and_pids(list: &str) -> bool {
    let names: Vec<&str> = list.split_whitespace().collect();
    names.contains(&"memory") && names.contains(&"pids")
}

/// The modes to try, best first: v2 when this process's v2 cgroup has the `memory` and `pids`
/// controllers (`v2_controllers`: its `cgroup.controllers`), then v1 when both hierarchies are
/// mounted.
pub(super) fn candidates(offer: &Offer, v2_controllers: Option<&str>) -> Vec<Mode> {
    let mut out = Vec::new();
    if let (Some(dir), Some(c)) = (&offer.v2, v2_controllers) {
        if has_memory_and_pids(c) {
            out.push(Mode::V2 {
                parent: dir.clone(),
            });
        }
    }
    if let (Some(memory), Some(pids)) = (&offer.v1_memory, &offer.v1_pids) {
        out.push(Mode::V1 {
            memory: memory.clone(),
            pids: pids.clone(),
        });
    }
    out
}

/// Which controller's directory a limit file is in (v2 has one directory for both).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ctl {
    Memory,
    Pids,
}

/// One limit file of a sandbox cgroup, written in order; an `optional` file that does not
/// exist (no swap accounting) is skipped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Setting {
    pub ctl: Ctl,
    pub file: &'static str,
    pub value: String,
    pub optional: bool,
}

/// The limit files for a sandbox of `memory_mb` MiB and `processes` processes and threads.
/// The sandbox init is in the cgroup too, hence one more pid. Swap is held to the same
/// total (v1: memory+swap equal to memory, which must be written after it; v2: no swap),
/// so a sandbox cannot push its excess out to swap.
pub(super) fn settings(v2: bool, memory_mb: u64, processes: u64) -> Vec<Setting> {
    let bytes = memory_mb.saturating_mul(1 << 20).to_string();
    let pids = processes.saturating_add(1).to_string();
    let s = |ctl, file, value: &str, optional| Setting {
        ctl,
        file,
        value: value.to_string(),
        optional,
    };
    if v2 {
        vec![
            s(Ctl::Memory, "memory.max", &bytes, false),
            s(Ctl::Memory, "memory.swap.max", "0", true),
            s(Ctl::Pids, "pids.max", &pids, false),
        ]
    } else {
        vec![
            s(Ctl::Memory, "memory.limit_in_bytes", &bytes, false),
            s(Ctl::Memory, "memory.memsw.limit_in_bytes", &bytes, true),
            s(Ctl::Pids, "pids.max", &pids, false),
        ]
    }
}

/// The `oom_kill` count of a v2 `memory.events` or v1 `memory.oom_control` text.
pub(super) fn oom_kills(text: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

fn write(file: &Path, value: &str) -> Result<(), CgroupError> {
    std::fs::write(file, value).map_err(|source| CgroupError::Write {
        file: file.to_path_buf(),
        value: value.to_string(),
        source,
    })
}

/// One sandbox's cgroup (one directory per hierarchy). Removed by [`Cgroup::remove`], or on
/// drop as a last resort.
#[derive(Debug)]
pub(super) struct Cgroup {
    /// v2: one directory; v1: the memory then the pids directory.
    dirs: Vec<PathBuf>,
    v2: bool,
    removed: bool,
}

impl Cgroup {
    /// Creates a fresh cgroup for one sandbox under `mode` with these limits; `None` when
    /// `mode` is [`Mode::Off`].
    pub(super) fn create(
        mode: &Mode,
        memory_mb: u64,
        processes: u64,
    ) -> Result<Option<Cgroup>, CgroupError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let (parents, v2): (Vec<&Path>, bool) = match mode {
            Mode::V2 { parent } => (vec![parent], true),
            Mode::V1 { memory, pids } => (vec![memory, pids], false),
            Mode::Off(_) => return Ok(None),
        };
        let mut cg = Cgroup {
            dirs: Vec::new(),
            v2,
            removed: false,
        };
        // A name left by an earlier process with the same pid is skipped, never reused.
        'name: loop {
            let name = format!(
                "clawrl-sandbox-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            );
            for p in &parents {
                let dir = p.join(&name);
                match std::fs::create_dir(&dir) {
                    Ok(()) => cg.dirs.push(dir),
                    Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                        cg.remove_dirs()?;
                        cg.dirs.clear();
                        continue 'name;
                    }
                    Err(source) => return Err(CgroupError::Create { dir, source }),
                }
            }
            break;
        }
        for s in settings(v2, memory_mb, processes) {
            let file = cg.dir(s.ctl).join(s.file);
            if s.optional && !file.exists() {
                continue;
            }
            write(&file, &s.value)?;
        }
        Ok(Some(cg))
    }

    fn dir(&self, ctl: Ctl) -> &Path {
        match (self.v2, ctl) {
            (true, _) | (false, Ctl::Memory) => &self.dirs[0],
            (false, Ctl::Pids) => &self.dirs[1],
        }
    }

    /// Moves the process `pid` (all its threads) into the cgroup.
    pub(super) fn join(&self, pid: libc::pid_t) -> Result<(), CgroupError> {
        for d in &self.dirs {
            write(&d.join("cgroup.procs"), &pid.to_string())?;
        }
        Ok(())
    }

    /// How many processes the kernel's OOM killer has killed in the cgroup.
    pub(super) fn oom_kills(&self) -> u64 {
        let file = if self.v2 {
            "memory.events"
        } else {
            "memory.oom_control"
        };
        std::fs::read_to_string(self.dir(Ctl::Memory).join(file))
            .map(|t| oom_kills(&t))
            .unwrap_or(0)
    }

    /// Kills whatever is left in the cgroup, then removes it. Blocks until the processes are
    /// gone (at most a few seconds: a killed process only has to finish exiting).
    pub(super) fn remove(mut self) -> Result<(), CgroupError> {
        self.removed = true;
        self.kill_all();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match self.remove_dirs() {
                // EBUSY: a killed process has not finished exiting yet.
                Err(CgroupError::Remove { source, .. })
                    if source.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline =>
                {
                    self.kill_all();
                    std::thread::sleep(Duration::from_millis(5));
                }
                r => return r,
            }
        }
    }

    /// SIGKILL to every process in the cgroup (`cgroup.kill` on v2 kernels that have it).
    fn kill_all(&self) {
        if self.v2 && std::fs::write(self.dirs[0].join("cgroup.kill"), "1").is_ok() {
            return;
        }
        for d in &self.dirs {
            let Ok(procs) = std::fs::read_to_string(d.join("cgroup.procs")) else {
                continue;
            };
            for pid in procs
                .lines()
                .filter_map(|l| l.trim().parse::<libc::pid_t>().ok())
            {
                // SAFETY: kill has no memory preconditions; the pid is a member of the
                // sandbox's cgroup, listed in this process's pid namespace.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }

    fn remove_dirs(&mut self) -> Result<(), CgroupError> {
        while let Some(dir) = self.dirs.last() {
            match std::fs::remove_dir(dir) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(source) => {
                    return Err(CgroupError::Remove {
                        dir: dir.clone(),
                        source,
                    })
                }
            }
            self.dirs.pop();
        }
        Ok(())
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        if !self.removed {
            self.kill_all();
            let _ = self.remove_dirs();
        }
    }
}

/// The host pid in a sandbox cgroup's name (`clawrl-sandbox-<pid>-<n>`).
pub(super) fn owner_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("clawrl-sandbox-")?;
    let (pid, n) = rest.split_once('-')?;
    n.parse::<u64>().ok()?;
    pid.parse().ok()
}

/// Removes the empty sandbox cgroups under `mode`'s parents whose host process is gone (no
/// `/proc/<pid>`; a pid reused since keeps its cgroups until a later sweep). A cgroup that still
/// holds processes is refused by the kernel and stays.
fn sweep(mode: &Mode) {
    let parents: Vec<&Path> = match mode {
        Mode::V2 { parent } => vec![parent],
        Mode::V1 { memory, pids } => vec![memory, pids],
        Mode::Off(_) => return,
    };
    for p in parents {
        let Ok(rd) = std::fs::read_dir(p) else {
            continue;
        };
        for e in rd.flatten() {
            let name = e.file_name();
            let Some(pid) = name.to_str().and_then(owner_pid) else {
                continue;
            };
            let gone = pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists();
            if gone && std::fs::remove_dir(e.path()).is_ok() {
                tracing::info!(cgroup = %e.path().display(), "sandbox: removed a stale cgroup");
            }
        }
    }
}

/// Tries `mode` by creating, limiting and removing a probe cgroup (v2: after handing `memory`
/// and `pids` to the children of the parent when they are not yet).
fn try_mode(mode: &Mode) -> Result<(), String> {
    if let Mode::V2 { parent } = mode {
        let file = parent.join("cgroup.subtree_control");
        let now = std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        if !has_memory_and_pids(&now) {
            write(&file, "+memory +pids").map_err(|e| e.to_string())?;
        }
    }
    let cg = Cgroup::create(mode, 64, 16).map_err(|e| e.to_string())?;
    if let Some(cg) = cg {
        cg.remove().map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// How sandboxes are limited on this host, decided once per process (see the module docs).
pub(super) fn mode() -> &'static Mode {
    static MODE: OnceLock<Mode> = OnceLock::new();
    MODE.get_or_init(|| {
        let mode = detect();
        match &mode {
            Mode::Off(why) => tracing::warn!(
                "sandbox: no cgroup limits ({why}); memory is limited by RLIMIT_AS (address \
                 space) and processes by RLIMIT_NPROC only"
            ),
            Mode::V2 { parent } => {
                tracing::info!(parent = %parent.display(), "sandbox: cgroup v2 limits")
            }
            Mode::V1 { memory, pids } => tracing::info!(
                memory = %memory.display(),
                pids = %pids.display(),
                "sandbox: cgroup v1 limits"
            ),
        }
        mode
    })
}

fn detect() -> Mode {
    if std::env::var_os("CLAWRL_SANDBOX_CGROUPS").is_some_and(|v| v == "off") {
        return Mode::Off("CLAWRL_SANDBOX_CGROUPS=off".into());
    }
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let offer = offer(&read("/proc/self/cgroup"), &read("/proc/self/mountinfo"));
    let v2_controllers = offer
        .v2
        .as_ref()
        .and_then(|d| std::fs::read_to_string(d.join("cgroup.controllers")).ok());
    let mut tried = Vec::new();
    for m in candidates(&offer, v2_controllers.as_deref()) {
        match try_mode(&m) {
            Ok(()) => {
                sweep(&m);
                return m;
            }
            Err(e) => tried.push(e),
        }
    }
    if tried.is_empty() {
        Mode::Off(
            "neither a cgroup v2 with the memory and pids controllers nor the v1 memory and \
             pids hierarchies are available to this process"
                .into(),
        )
    } else {
        Mode::Off(tried.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO_HYBRID: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";
    const CGROUP_HYBRID: &str = "\
8:pids:/
4:memory:/process_api/cb86
1:cpu:/
0::/
";

    #[test]
    fn a_hybrid_host_offers_v1_memory_and_pids_below_this_process() {
        let o = offer(CGROUP_HYBRID, MOUNTINFO_HYBRID);
        assert_eq!(
            o.v1_memory,
            Some("/sys/fs/cgroup/memory/process_api/cb86".into())
        );
        assert_eq!(o.v1_pids, Some("/sys/fs/cgroup/pids".into()));
        assert_eq!(o.v2, Some("/sys/fs/cgroup/unified".into()));
        // The unified hierarchy there has no controllers: v1 is the only candidate.
        let c = candidates(&o, Some(""));
        assert_eq!(
            c,
            vec![Mode::V1 {
                memory: "/sys/fs/cgroup/memory/process_api/cb86".into(),
                pids: "/sys/fs/cgroup/pids".into()
            }]
        );
    }

    #[test]
    fn a_v2_host_with_the_controllers_comes_first() {
        let mi = "25 1 0:22 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n";
        let o = offer("0::/system.slice/clawrl.service\n", mi);
        assert_eq!(
            o.v2,
            Some("/sys/fs/cgroup/system.slice/clawrl.service".into())
        );
        assert_eq!(
            candidates(&o, Some("cpuset cpu io memory hugetlb pids rdma")),
            vec![Mode::V2 {
                parent: "/sys/fs/cgroup/system.slice/clawrl.service".into()
            }]
        );
        // Without pids delegated there is nothing to use.
        assert!(candidates(&o, Some("cpu memory")).is_empty());
        assert!(candidates(&o, None).is_empty());
    }

    #[test]
    fn mounts_of_a_subtree_and_escaped_paths_resolve() {
        // A container that sees its own cgroup mounted as the root of the hierarchy.
        let mi =
            "35 31 0:32 /docker/abc /sys/fs/cgroup/memory\\040x rw - cgroup cgroup rw,memory\n\
                  36 31 0:33 /other /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids\n";
        let o = offer("4:memory:/docker/abc/inner\n5:pids:/docker/abc\n", mi);
        assert_eq!(o.v1_memory, Some("/sys/fs/cgroup/memory x/inner".into()));
        // The pids mount shows another subtree: this process's cgroup is not in it.
        assert_eq!(o.v1_pids, None);
        assert!(candidates(&o, None).is_empty());
        assert_eq!(resolve("/a", "/m", "/ab"), None);
        assert_eq!(resolve("/", "/m", "/a/../b"), None);
        assert_eq!(resolve("/a", "/m", "/a"), Some("/m".into()));
        // Nothing mounted: nothing offered.
        assert_eq!(offer(CGROUP_HYBRID, ""), Offer::default());
    }

    #[test]
    fn limits_count_the_init_and_hold_swap_to_the_memory_limit() {
        let v1 = settings(false, 256, 64);
        let files: Vec<(&str, &str)> = v1.iter().map(|s| (s.file, s.value.as_str())).collect();
        assert_eq!(
            files,
            vec![
                ("memory.limit_in_bytes", "268435456"),
                ("memory.memsw.limit_in_bytes", "268435456"),
                ("pids.max", "65"),
            ]
        );
        assert!(v1[1].optional && !v1[0].optional);
        let v2 = settings(true, 2048, 256);
        assert_eq!(v2[0].file, "memory.max");
        assert_eq!(v2[0].value, (2048u64 << 20).to_string());
        assert_eq!(v2[1].file, "memory.swap.max");
        assert_eq!(v2[2].value, "257");
        assert_eq!(
            oom_kills("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n"),
            3
        );
        assert_eq!(oom_kills("low 0\nhigh 0\nmax 7\noom 2\noom_kill 2\n"), 2);
        assert_eq!(oom_kills(""), 0);
    }

    #[test]
    fn sandbox_cgroup_names_carry_their_host_pid() {
        assert_eq!(owner_pid("clawrl-sandbox-4242-7"), Some(4242));
        for other in [
            "clawrl-sandbox-4242",
            "clawrl-sandbox-x-1",
            "clawrl-sandbox-1-x",
            "system.slice",
            "clawrl-4242-1",
        ] {
            assert_eq!(owner_pid(other), None, "{other}");
        }
    }
}
