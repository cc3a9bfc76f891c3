//! TensorBoard event files: the scalars of a run, written so TensorBoard (and anything that
//! reads its format) can plot them.
//!
//! A file is a sequence of TFRecords: the data's length as a little-endian u64, the masked
//! CRC-32C of those 8 bytes, the data, the masked CRC-32C of the data. A CRC is masked as
//! `((crc >> 15) | (crc << 17)) + 0xa282ead8` (wrapping). Each record's data is one `Event`
//! protobuf: `wall_time` (field 1, double), `step` (2, int64), `file_version` (3, string; the
//! first record of a file says `brain.Event:2`), `summary` (5, a `Summary` whose repeated
//! `value` (1) is a `Value` with `tag` (1, string) and `simple_value` (2, float)). The few
//! fields are encoded here by hand.
//!
//! TensorBoard finds files whose name contains `tfevents`; [`EventWriter::create`] names them
//! `events.out.tfevents.<unix seconds>.<host>.<pid>.<n>` so two writers never share a file.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Why an event file could not be written.
#[derive(Debug, thiserror::Error)]
pub enum EventsError {
    /// Creating the directory or the file, or writing it, failed.
    #[error("TensorBoard events {path}: {source}")]
    Io {
        /// The file (or directory).
        path: PathBuf,
        /// The IO error.
        source: std::io::Error,
    },
}

/// The CRC-32C of `data`, masked as TFRecord stores it.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// `data` framed as one TFRecord.
pub fn tfrecord(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    out
}

/// Why bytes are not a whole sequence of TFRecords.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The bytes end inside the record starting at `offset`.
    #[error("a record at byte {offset} is cut short")]
    Truncated {
        /// Where the record starts.
        offset: usize,
    },
    /// A CRC does not match.
    #[error("the {what} CRC of the record at byte {offset} does not match")]
    Crc {
        /// Where the record starts.
        offset: usize,
        /// `length` or `data`.
        what: &'static str,
    },
}

/// The data of each TFRecord in `bytes`, both CRCs checked.
pub fn tfrecords(bytes: &[u8]) -> Result<Vec<&[u8]>, FrameError> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let cut = FrameError::Truncated { offset: at };
        let head = bytes.get(at..at + 12).ok_or(cut.clone())?;
        let (len, crc) = head.split_at(8);
        if u32::from_le_bytes(crc.try_into().expect("4 bytes")) != masked_crc32c(len) {
            return Err(FrameError::Crc {
                offset: at,
                what: "length",
            });
        }
        let n = u64::from_le_bytes(len.try_into().expect("8 bytes")) as usize;
        let end = (at + 12).checked_add(n).ok_or(cut.clone())?;
        let data = bytes.get(at + 12..end).ok_or(cut.clone())?;
        let crc = bytes.get(end..end + 4).ok_or(cut)?;
        if u32::from_le_bytes(crc.try_into().expect("4 bytes")) != masked_crc32c(data) {
            return Err(FrameError::Crc {
                offset: at,
                what: "data",
            });
        }
        out.push(data);
        at = end + 4;
    }
    Ok(out)
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A length-delimited field (wire type 2).
fn bytes_field(out: &mut Vec<u8>, field: u64, data: &[u8]) {
    varint(out, field << 3 | 2);
    varint(out, data.len() as u64);
    out.extend_from_slice(data);
}

fn event_head(wall_time: f64, step: Option<i64>) -> Vec<u8> {
    let mut out = Vec::new();
    varint(&mut out, 1 << 3 | 1);
    out.extend_from_slice(&wall_time.to_le_bytes());
    if let Some(step) = step {
        varint(&mut out, 2 << 3);
        varint(&mut out, step as u64);
    }
    out
}

/// The `Event` that opens every file: its format version.
pub fn file_version_event(wall_time: f64) -> Vec<u8> {
    let mut out = event_head(wall_time, None);
    bytes_field(&mut out, 3, b"brain.Event:2");
    out
}

/// An `Event` holding one scalar summary value.
pub fn scalar_event(wall_time: f64, step: i64, tag: &str, value: f32) -> Vec<u8> {
    let mut v = Vec::new();
    bytes_field(&mut v, 1, tag.as_bytes());
    varint(&mut v, 2 << 3 | 5);
    v.extend_from_slice(&value.to_le_bytes());
    let mut summary = Vec::new();
    bytes_field(&mut summary, 1, &v);
    let mut out = event_head(wall_time, Some(step));
    bytes_field(&mut out, 5, &summary);
    out
}

/// Appends scalar events to one new event file.
pub struct EventWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl EventWriter {
    /// Creates `dir` if needed and a new event file in it, opened by its version record.
    pub fn create(dir: &Path, wall_time: f64) -> Result<Self, EventsError> {
        static SERIAL: AtomicU64 = AtomicU64::new(0);
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| EventsError::Io { path, source }
        };
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .ok()
            .filter(|h| !h.is_empty() && !h.contains('/'))
            .unwrap_or_else(|| "localhost".into());
        let path = dir.join(format!(
            "events.out.tfevents.{}.{host}.{}.{}",
            wall_time as u64,
            std::process::id(),
            SERIAL.fetch_add(1, Ordering::Relaxed)
        ));
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(io(&path))?;
        let mut w = EventWriter {
            path,
            out: BufWriter::new(file),
        };
        w.write_event(&file_version_event(wall_time))?;
        w.flush()?;
        Ok(w)
    }

    /// The file written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn write_event(&mut self, event: &[u8]) -> Result<(), EventsError> {
        self.out
            .write_all(&tfrecord(event))
            .map_err(|source| EventsError::Io {
                path: self.path.clone(),
                source,
            })
    }

    /// Appends one scalar (TensorBoard stores scalars as 32-bit floats).
    pub fn scalar(
        &mut self,
        tag: &str,
        step: u64,
        value: f64,
        wall_time: f64,
    ) -> Result<(), EventsError> {
        self.write_event(&scalar_event(wall_time, step as i64, tag, value as f32))
    }

    /// Hands what was written to the OS, so a reader sees it.
    pub fn flush(&mut self) -> Result<(), EventsError> {
        self.out.flush().map_err(|source| EventsError::Io {
            path: self.path.clone(),
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_and_its_mask_match_the_known_vectors() {
        // The CRC-32C check value of "123456789" (RFC 3720, appendix B.4).
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(masked_crc32c(b"123456789"), 0xc78a_b0e5);
    }

    #[test]
    fn the_file_version_record_is_byte_exact() {
        // Computed independently (bitwise CRC-32C in Python) for wall_time 1.5.
        let want =
            "1800000000000000a37f4b2209000000000000f83f1a0d627261696e2e4576656e743a322a28646c";
        let got: String = tfrecord(&file_version_event(1.5))
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn a_scalar_event_encodes_its_fields() {
        let e = scalar_event(2.0, 300, "train/loss", 0.5);
        let mut want = vec![0x09];
        want.extend_from_slice(&2.0f64.to_le_bytes());
        want.extend_from_slice(&[0x10, 0xac, 0x02]); // step 300 as a varint
                                                     // summary (5) { value (1) { tag (1) "train/loss", simple_value (2) 0.5f } }
        let mut value = vec![0x0a, 10];
        value.extend_from_slice(b"train/loss");
        value.push(0x15);
        value.extend_from_slice(&0.5f32.to_le_bytes());
        want.extend_from_slice(&[0x2a, value.len() as u8 + 2, 0x0a, value.len() as u8]);
        want.extend_from_slice(&value);
        assert_eq!(e, want);
    }

    #[test]
    fn a_writer_frames_every_event_with_checked_lengths() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path(), 10.0).unwrap();
        w.scalar("a", 1, 1.0, 11.0).unwrap();
        w.scalar("b", 2, -2.0, 12.0).unwrap();
        w.flush().unwrap();
        assert!(w
            .path()
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .contains("tfevents"));
        let bytes = std::fs::read(w.path()).unwrap();
        let records = tfrecords(&bytes).unwrap();
        assert_eq!(records.len(), 3);
        assert_eq!(records[0], &file_version_event(10.0)[..]);
        assert_eq!(records[2], &scalar_event(12.0, 2, "b", -2.0)[..]);
        // A cut file and a flipped byte are refused.
        let cut = &bytes[..bytes.len() - 1];
        assert!(matches!(tfrecords(cut), Err(FrameError::Truncated { .. })));
        let mut flipped = bytes.clone();
        flipped[20] ^= 1;
        assert_eq!(
            tfrecords(&flipped),
            Err(FrameError::Crc {
                offset: 0,
                what: "data"
            })
        );
    }
}
