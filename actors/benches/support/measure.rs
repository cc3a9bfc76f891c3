//! What the actor-crate benches share to report a run honestly: settings from the environment,
//! medians, and the machine's load average.

#![allow(dead_code)]

/// The number in environment variable `name`, or `default`.
pub fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The median of `v` (the mean of the middle two for an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Prints the one-minute load average (Linux `/proc/loadavg`) `when`, warning before a run
/// when other work shares the machine; the figure after a run includes the bench's own busy
/// threads.
pub fn print_load(when: &str) {
    let load: f64 = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN);
    let warn = if when == "before" && load > 0.5 {
        "  WARNING: above 0.5, other work shares this machine and the ratios are not results"
    } else {
        ""
    };
    println!("load average {when}: {load:.2}{warn}");
}
