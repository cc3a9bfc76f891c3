//! Where the policy and the learner compute: the `--device` value (`cpu` or `cuda:N`), its
//! parsing with errors naming the accepted forms, a probe that turns a missing CUDA driver or GPU
//! into an error instead of a panic, and the dispatch that runs backend-generic work on
//! [`CpuBackend`](crate::CpuBackend) or, in a build with the `cuda` feature, on Burn's CUDA
//! backend (with [`Autodiff`](burn::backend::Autodiff) over it for training).
//!
//! Callers write their work once, generic over the backend, as an [`InferenceTask`] or a
//! [`TrainingTask`], and hand it to [`Device::run_inference`] or [`Device::run_training`].

use std::fmt;
use std::str::FromStr;

use burn::tensor::backend::{AutodiffBackend, Backend};

use crate::model::Qwen3;

/// The accepted spellings, for error messages and help texts.
pub const ACCEPTED_FORMS: &str = "`cpu` or `cuda:N` (N = GPU index, e.g. `cuda:0`)";

/// A compute device named on the command line or in a config file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    /// The CPU, through Burn's pure-Rust Flex backend (the default).
    #[default]
    Cpu,
    /// The CUDA GPU with this index, through Burn's CUDA backend (needs the `cuda` feature).
    Cuda(usize),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// In config files a device is the same string as on the command line.
impl serde::Serialize for Device {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Device {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Why a device value was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid device `{value}`: {reason}; expected {ACCEPTED_FORMS}")]
pub struct ParseDeviceError {
    /// The value as given.
    pub value: String,
    /// What is wrong with it.
    pub reason: String,
}

impl FromStr for Device {
    type Err = ParseDeviceError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |reason: String| ParseDeviceError {
            value: s.to_string(),
            reason,
        };
        if s == "cpu" {
            return Ok(Device::Cpu);
        }
        if s == "cuda" {
            return Err(bad("a CUDA device needs its GPU index".to_string()));
        }
        match s.strip_prefix("cuda:") {
            Some(n) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => n
                .parse::<usize>()
                .map(Device::Cuda)
                .map_err(|_| bad(format!("GPU index `{n}` is too large"))),
            Some(n) => Err(bad(format!("`{n}` is not a GPU index"))),
            None => Err(bad("unknown device".to_string())),
        }
    }
}

/// Why a device could not be used.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// A CUDA device was asked of a binary built without the `cuda` feature.
    #[error(
        "device `{0}` needs CUDA, but this clawrl binary was built without CUDA support; \
         rebuild it with `cargo build --release --features cuda` (no CUDA toolkit is needed to \
         build; the driver is loaded at run time)"
    )]
    CudaNotBuilt(Device),
    /// The CUDA driver, or the GPU with this index, is missing or failed a first operation.
    #[error("no usable CUDA device `{device}`: {reason}")]
    CudaUnusable {
        /// The device asked for.
        device: Device,
        /// What the backend reported (driver library not found, no such GPU, ...).
        reason: String,
    },
}

/// Backend-generic inference work (loading a checkpoint, scoring, generating) to run on the
/// backend a [`Device`] selects.
pub trait InferenceTask {
    /// What the work returns.
    type Output;
    /// Runs the work on backend `B`, placing tensors on `device`.
    fn run<B: Backend>(self, device: B::Device) -> Self::Output
    where
        Qwen3<B>: Send + Sync;
}

/// Backend-generic training work to run on the autodiff backend a [`Device`] selects.
pub trait TrainingTask {
    /// What the work returns.
    type Output;
    /// Runs the work on autodiff backend `B`, placing tensors on `device`.
    fn run<B: AutodiffBackend>(self, device: B::Device) -> Self::Output;
}

/// Burn's CUDA backend in float32 (available with the `cuda` feature).
#[cfg(feature = "cuda")]
pub type CudaBackend = burn::backend::Cuda;
/// The CUDA backend with automatic differentiation, used by the learner on a GPU.
#[cfg(feature = "cuda")]
pub type CudaAutodiff = burn::backend::Autodiff<CudaBackend>;

/// Whether `B` is the CUDA backend, with or without autodiff (never, without the `cuda`
/// feature). Model code picks GPU-specific paths by it, since Rust has no specialisation.
pub fn is_cuda<B: 'static>() -> bool {
    #[cfg(feature = "cuda")]
    {
        use std::any::TypeId;
        let b = TypeId::of::<B>();
        b == TypeId::of::<CudaBackend>() || b == TypeId::of::<CudaAutodiff>()
    }
    #[cfg(not(feature = "cuda"))]
    false
}

/// Runs `work` on a thread of the CPU backend's pool (rayon's global pool) when `B` is not the
/// CUDA backend, with the pool's other workers kept awake until it returns
/// ([`keep_taking_work`]); on the calling thread otherwise.
///
/// Each CPU op splits its work across the pool. Called from a thread outside the pool, every
/// such op hands all its parts to the pool's threads and puts the caller to sleep until they
/// are done, so each op wakes a worker and then the caller. A decode step at batch 1 runs
/// about thirty such products of 20–60 µs each; the wake-ups were about a fifth of its profile.
/// From inside the pool an op's first part runs on the calling worker and only the rest is
/// handed over, often to a worker still spinning after the previous op. A CUDA backend keeps
/// its calling thread, whose stream its launches are queued on.
pub fn on_compute_pool<B: 'static, R: Send>(work: impl FnOnce() -> R + Send) -> R {
    if is_cuda::<B>() {
        return work();
    }
    let done = std::sync::atomic::AtomicBool::new(false);
    let mut out = None;
    rayon::scope(|s| {
        for _ in 1..rayon::current_num_threads() {
            s.spawn(|_| keep_taking_work(&done));
        }
        out = Some(work());
        done.store(true, std::sync::atomic::Ordering::Release);
    });
    out.expect("the scope ran its body")
}

/// Runs the pool's pending jobs on this worker until `done`, spinning between them instead of
/// going to sleep.
///
/// A pool worker with nothing to do sleeps after a few tens of microseconds, and waking it
/// costs a system call and an inter-processor interrupt (expensive in a virtual machine). A
/// decode step's parallel products come every 50–150 µs with single-threaded work between
/// them, so without this the second core was asleep at nearly every product. The spinning
/// lasts one call of [`on_compute_pool`] and costs the other cores' time while it lasts, as an
/// OpenMP runtime's spin-wait does; a job that arrives meanwhile, from this work or any other
/// (a training step's), runs at once. The call returns once each keeper has finished the job
/// it was running.
fn keep_taking_work(done: &std::sync::atomic::AtomicBool) {
    while !done.load(std::sync::atomic::Ordering::Acquire) {
        if rayon::yield_now() != Some(rayon::Yield::Executed) {
            std::hint::spin_loop();
        }
    }
}

impl Device {
    /// Checks that this device can be used, without running anything on the CPU: always `Ok`
    /// for [`Device::Cpu`]; for a CUDA device, an error unless the binary has the `cuda`
    /// feature and a first tiny operation on the GPU succeeds.
    pub fn check(self) -> Result<(), DeviceError> {
        match self {
            Device::Cpu => Ok(()),
            Device::Cuda(index) => {
                probe_cuda(self, index)?;
                Ok(())
            }
        }
    }

    /// The Burn device of a CUDA device, after probing it (the `cuda` feature's backend).
    #[cfg(feature = "cuda")]
    pub fn cuda(self) -> Result<burn::backend::cuda::CudaDevice, DeviceError> {
        match self {
            Device::Cuda(index) => probe_cuda(self, index),
            Device::Cpu => Err(DeviceError::CudaUnusable {
                device: self,
                reason: "not a CUDA device".into(),
            }),
        }
    }

    /// Runs `task` on the inference backend of this device, after probing a CUDA device.
    pub fn run_inference<T: InferenceTask>(self, task: T) -> Result<T::Output, DeviceError> {
        match self {
            Device::Cpu => Ok(task.run::<crate::CpuBackend>(Default::default())),
            Device::Cuda(index) => {
                #[cfg(feature = "cuda")]
                {
                    let device = probe_cuda(self, index)?;
                    Ok(task.run::<CudaBackend>(device))
                }
                #[cfg(not(feature = "cuda"))]
                {
                    let _ = (task, index);
                    Err(DeviceError::CudaNotBuilt(self))
                }
            }
        }
    }

    /// Runs `task` on the autodiff backend of this device, after probing a CUDA device.
    pub fn run_training<T: TrainingTask>(self, task: T) -> Result<T::Output, DeviceError> {
        match self {
            Device::Cpu => Ok(task.run::<crate::CpuAutodiff>(Default::default())),
            Device::Cuda(index) => {
                #[cfg(feature = "cuda")]
                {
                    let device = probe_cuda(self, index)?;
                    Ok(task.run::<CudaAutodiff>(device))
                }
                #[cfg(not(feature = "cuda"))]
                {
                    let _ = (task, index);
                    Err(DeviceError::CudaNotBuilt(self))
                }
            }
        }
    }
}

/// Without the `cuda` feature no CUDA device is usable.
#[cfg(not(feature = "cuda"))]
fn probe_cuda(device: Device, _index: usize) -> Result<(), DeviceError> {
    Err(DeviceError::CudaNotBuilt(device))
}

/// Opens GPU `index` and runs one tiny addition on it. Burn's CUDA backend panics when the
/// driver library cannot be loaded or the GPU does not exist, on this thread or on its device
/// thread; the panic is caught here, its message kept out of stderr, and the first panic message
/// (the root cause, also when it came from the device thread) is returned as
/// [`DeviceError::CudaUnusable`].
#[cfg(feature = "cuda")]
fn probe_cuda(
    device: Device,
    index: usize,
) -> Result<burn::backend::cuda::CudaDevice, DeviceError> {
    use std::sync::{Arc, Mutex};

    use burn::tensor::Tensor;

    let cuda = burn::backend::cuda::CudaDevice::new(index);
    let probe_device = cuda.clone();
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let previous_hook = std::panic::take_hook();
    let record = seen.clone();
    std::panic::set_hook(Box::new(move |info| {
        if let Ok(mut v) = record.lock() {
            v.push(panic_message(info.payload()));
        }
    }));
    let outcome = std::panic::catch_unwind(move || {
        let t = Tensor::<CudaBackend, 1>::from_floats([1.0, 2.0], &probe_device);
        (t.clone() + t).into_data().to_vec::<f32>()
    });
    std::panic::set_hook(previous_hook);
    let unusable = |reason: String| DeviceError::CudaUnusable { device, reason };
    match outcome {
        Ok(Ok(v)) if v == [2.0, 4.0] => Ok(cuda),
        Ok(Ok(v)) => Err(unusable(format!(
            "a test addition returned {v:?} instead of [2.0, 4.0]"
        ))),
        Ok(Err(e)) => Err(unusable(format!("reading a test tensor failed: {e:?}"))),
        Err(payload) => {
            let first = seen.lock().ok().and_then(|v| v.first().cloned());
            Err(unusable(
                first.unwrap_or_else(|| panic_message(payload.as_ref())),
            ))
        }
    }
}

/// The text of a caught panic.
#[cfg(feature = "cuda")]
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "the CUDA backend panicked while opening the device".to_string()
    }
}

/// Why the `device` key of a TOML config was refused.
#[derive(Debug, thiserror::Error)]
pub enum DeviceKeyError {
    /// The key is there but is not a string.
    #[error("{origin}: key `device` must be a string, {ACCEPTED_FORMS}")]
    NotAString {
        /// The config's name (its path).
        origin: String,
    },
    /// The string is not a device.
    #[error("{origin}: key `device`: {source}")]
    Invalid {
        /// The config's name (its path).
        origin: String,
        /// The parse error.
        source: ParseDeviceError,
    },
}

/// Takes a top-level `device = "..."` key out of TOML text for a config whose own parser refuses
/// unknown keys. Returns the device (if the key is there) and the text with that key's line(s)
/// blanked to spaces, so every other byte keeps its offset and the config parser's error
/// positions stay true. Text that is not valid TOML is returned unchanged, with no device, for
/// the config parser to report.
pub fn take_device_key(
    text: &str,
    origin: &str,
) -> Result<(Option<Device>, String), DeviceKeyError> {
    #[derive(serde::Deserialize)]
    struct DeviceKey {
        device: Option<toml::Spanned<toml::Value>>,
    }
    let Ok(DeviceKey {
        device: Some(spanned),
    }) = toml::from_str::<DeviceKey>(text)
    else {
        return Ok((None, text.to_string()));
    };
    let span = spanned.span();
    let toml::Value::String(value) = spanned.into_inner() else {
        return Err(DeviceKeyError::NotAString {
            origin: origin.to_string(),
        });
    };
    let device = value
        .parse::<Device>()
        .map_err(|source| DeviceKeyError::Invalid {
            origin: origin.to_string(),
            source,
        })?;
    // A top-level key/value pair owns its lines: from the start of the line holding the key to
    // the end of the line where the value ends (a comment after it included).
    let start = text[..span.start].rfind('\n').map_or(0, |i| i + 1);
    let end = text[span.end..]
        .find('\n')
        .map_or(text.len(), |i| span.end + i);
    let mut out = String::with_capacity(text.len());
    out.push_str(&text[..start]);
    out.extend(
        text[start..end]
            .bytes()
            .map(|b| if b == b'\n' { '\n' } else { ' ' }),
    );
    out.push_str(&text[end..]);
    Ok((Some(device), out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_cpu_and_indexed_cuda() {
        assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!("cuda:0".parse::<Device>().unwrap(), Device::Cuda(0));
        assert_eq!("cuda:12".parse::<Device>().unwrap(), Device::Cuda(12));
        assert_eq!(Device::default(), Device::Cpu);
        for d in [Device::Cpu, Device::Cuda(3)] {
            assert_eq!(d.to_string().parse::<Device>().unwrap(), d);
        }
    }

    #[test]
    fn refuses_other_spellings_naming_value_and_forms() {
        for v in [
            "cuda:x",
            "gpu",
            "cuda",
            "cuda:",
            "CPU",
            "cuda:-1",
            "cuda:+1",
            " cpu",
            "cuda:0 ",
            "",
            "cuda:99999999999999999999999",
        ] {
            let err = v.parse::<Device>().unwrap_err().to_string();
            assert!(err.contains(&format!("`{v}`")), "{v:?}: {err}");
            assert!(err.contains("`cpu` or `cuda:N`"), "{v:?}: {err}");
        }
    }

    #[test]
    fn cpu_always_checks_out() {
        Device::Cpu.check().unwrap();
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_says_how_to_build() {
        let err = Device::Cuda(0).check().unwrap_err().to_string();
        assert!(err.contains("`cuda:0`"), "{err}");
        assert!(err.contains("--features cuda"), "{err}");
    }

    #[test]
    fn device_key_is_taken_keeping_offsets() {
        let text = "lr = 1e-3\ndevice = \"cuda:1\" # the GPU\nbatch_size = 4\n";
        let (dev, rest) = take_device_key(text, "T.toml").unwrap();
        assert_eq!(dev, Some(Device::Cuda(1)));
        assert_eq!(rest.len(), text.len());
        assert_eq!(rest.find("batch_size"), text.find("batch_size"));
        assert!(!rest.contains("device"));
        let v: toml::Table = toml::from_str(&rest).unwrap();
        assert_eq!(v.keys().collect::<Vec<_>>(), ["batch_size", "lr"]);
    }

    #[test]
    fn device_key_absent_or_unparsable_text_is_left_alone() {
        for text in ["lr = 1e-3\n", "lr = = 2", "[t]\ndevice = \"cpu\"\n"] {
            let (dev, rest) = take_device_key(text, "T.toml").unwrap();
            assert_eq!((dev, rest.as_str()), (None, text));
        }
    }

    #[test]
    fn bad_device_key_names_file_key_and_value() {
        let err = take_device_key("device = \"gpu\"\n", "T.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("T.toml") && err.contains("`device`") && err.contains("`gpu`"));
        let err = take_device_key("device = 0\n", "T.toml")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("T.toml") && err.contains("must be a string"),
            "{err}"
        );
    }
}
