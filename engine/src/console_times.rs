//! When each part of a sandbox's console log was written, for `logs --since`.
//!
//! runsc appends the workload's output to the log itself (the sandbox's stdout is the
//! file), so no line carries a time and nothing on the host sees a write happen. The
//! node agent samples the log's length instead, every second, and appends a record to
//! `console.times` beside it whenever the log grew: "at this time the log was this
//! long". Bytes past a record's length were written after its time; the bytes up to it
//! at or before it. A `since` read therefore starts at the length of the last record
//! at or before the asked time (moved back to the start of its line): it may show up
//! to one sampling interval (or the time the agent was down) more than asked, never
//! less.
//!
//! A record is 16 bytes, little-endian: milliseconds since the Unix epoch, then the
//! log's length. Fixed-size records are searched by bisection, so a week-old chatty
//! log (one record a second: 9.7 MB) costs about 20 reads. A record cut short by a
//! crash is ignored.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The index's file name, beside the console log.
pub const FILE: &str = "console.times";
const RECORD: u64 = 16;

/// The index of the console log at `log`.
pub fn index_path(log: &Path) -> PathBuf {
    log.with_file_name(FILE)
}

/// Milliseconds since the Unix epoch (0 before it).
pub fn millis(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Appends "at `at_ms` the log was `len` bytes long".
pub fn record(index: &Path, at_ms: u64, len: u64) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(index)?;
    let mut rec = [0u8; RECORD as usize];
    rec[..8].copy_from_slice(&at_ms.to_le_bytes());
    rec[8..].copy_from_slice(&len.to_le_bytes());
    f.write_all(&rec)
}

fn read_record(f: &mut File, i: u64) -> std::io::Result<(u64, u64)> {
    let mut rec = [0u8; RECORD as usize];
    f.seek(SeekFrom::Start(i * RECORD))?;
    f.read_exact(&mut rec)?;
    let (t, l) = rec.split_at(8);
    let word = |b: &[u8]| {
        let mut w = [0u8; 8];
        w.copy_from_slice(b);
        u64::from_le_bytes(w)
    };
    Ok((word(t), word(l)))
}

/// The length the last record gives (what a restarted agent compares the log with);
/// 0 without an index.
pub fn last_length(index: &Path) -> std::io::Result<u64> {
    let mut f = match File::open(index) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    let n = f.metadata()?.len() / RECORD;
    if n == 0 {
        return Ok(0);
    }
    Ok(read_record(&mut f, n - 1)?.1)
}

/// The log's length at the last record at or before `since_ms`: every byte past it
/// was written after that record's time. 0 when no record is that old (or there is no
/// index: a log from before the agent kept one is shown whole).
pub fn length_at(index: &Path, since_ms: u64) -> std::io::Result<u64> {
    let mut f = match File::open(index) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    let n = f.metadata()?.len() / RECORD;
    // The first record later than `since_ms` (times only grow).
    let (mut lo, mut hi) = (0u64, n);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if read_record(&mut f, mid)?.0 <= since_ms {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    if lo == 0 {
        return Ok(0);
    }
    Ok(read_record(&mut f, lo - 1)?.1)
}

/// `at`, moved back to the start of the line it falls in (a record may fall inside a
/// line the workload was still printing).
pub fn line_start(f: &mut File, at: u64) -> std::io::Result<u64> {
    const BLOCK: u64 = 4 << 10;
    let mut end = at.min(f.seek(SeekFrom::End(0))?);
    let mut buf = vec![0u8; BLOCK as usize];
    while end > 0 {
        let start = end.saturating_sub(BLOCK);
        let n = (end - start) as usize;
        f.seek(SeekFrom::Start(start))?;
        f.read_exact(&mut buf[..n])?;
        if let Some(i) = buf[..n].iter().rposition(|b| *b == b'\n') {
            return Ok(start + i as u64 + 1);
        }
        end = start;
    }
    Ok(0)
}

/// Where a read of the log at `log` since `since` starts: the length at the last
/// record at or before it, moved back to the start of its line.
pub fn since_offset(log: &Path, f: &mut File, since: SystemTime) -> std::io::Result<u64> {
    let at = length_at(&index_path(log), millis(since))?;
    line_start(f, at)
}

/// The time `secs` seconds before `now` (the Unix epoch if that is before it).
pub fn seconds_before(now: SystemTime, secs: u64) -> SystemTime {
    now.checked_sub(Duration::from_secs(secs))
        .unwrap_or(UNIX_EPOCH)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn log(dir: &Path, text: &str) -> (PathBuf, File) {
        let p = dir.join("console.log");
        std::fs::write(&p, text).unwrap();
        let f = File::open(&p).unwrap();
        (p, f)
    }

    #[test]
    fn the_length_at_a_time_is_the_last_record_at_or_before_it() {
        let d = tempfile::tempdir().unwrap();
        let idx = d.path().join(FILE);
        assert_eq!(
            length_at(&idx, 5_000).unwrap(),
            0,
            "no index: the whole log"
        );
        for (t, l) in [(1_000, 10), (2_000, 25), (3_000, 40)] {
            record(&idx, t, l).unwrap();
        }
        assert_eq!(length_at(&idx, 999).unwrap(), 0);
        assert_eq!(length_at(&idx, 1_000).unwrap(), 10);
        assert_eq!(length_at(&idx, 2_500).unwrap(), 25);
        assert_eq!(length_at(&idx, 3_000).unwrap(), 40);
        assert_eq!(length_at(&idx, u64::MAX).unwrap(), 40);
        assert_eq!(last_length(&idx).unwrap(), 40);
        // A record cut short by a crash is not read.
        std::fs::OpenOptions::new()
            .append(true)
            .open(&idx)
            .unwrap()
            .write_all(&[1, 2, 3])
            .unwrap();
        assert_eq!(length_at(&idx, u64::MAX).unwrap(), 40);
        assert_eq!(last_length(&idx).unwrap(), 40);
    }

    #[test]
    fn bisection_finds_the_record_among_many() {
        let d = tempfile::tempdir().unwrap();
        let idx = d.path().join(FILE);
        for i in 1..=10_000u64 {
            record(&idx, i * 1_000, i * 7).unwrap();
        }
        assert_eq!(length_at(&idx, 4_321_500).unwrap(), 4_321 * 7);
        assert_eq!(length_at(&idx, 500).unwrap(), 0);
    }

    #[test]
    fn a_read_starts_at_the_start_of_a_line() {
        let d = tempfile::tempdir().unwrap();
        let (_, mut f) = log(d.path(), "one\ntwo\nthr");
        assert_eq!(line_start(&mut f, 0).unwrap(), 0);
        assert_eq!(
            line_start(&mut f, 4).unwrap(),
            4,
            "already at a line's start"
        );
        assert_eq!(line_start(&mut f, 6).unwrap(), 4, "inside `two`");
        assert_eq!(
            line_start(&mut f, 10).unwrap(),
            8,
            "inside the unfinished line"
        );
        assert_eq!(line_start(&mut f, 99).unwrap(), 8, "past the end");
        let long = format!("a\n{}", "x".repeat(10_000));
        let (_, mut f) = log(d.path(), &long);
        assert_eq!(line_start(&mut f, 9_000).unwrap(), 2, "across blocks");
    }

    #[test]
    fn since_reads_what_was_written_after_the_time() {
        let d = tempfile::tempdir().unwrap();
        let (p, mut f) = log(d.path(), "early 1\nearly 2\nlate 1\n");
        let idx = index_path(&p);
        record(&idx, 1_000, 8).unwrap();
        // Sampled in the middle of `late 1`'s write: the read starts at its line.
        record(&idx, 2_000, 19).unwrap();
        record(&idx, 3_000, 23).unwrap();
        let at = |ms: u64| {
            since_offset(
                &p,
                &mut File::open(&p).unwrap(),
                UNIX_EPOCH + Duration::from_millis(ms),
            )
            .unwrap()
        };
        assert_eq!(at(500), 0);
        assert_eq!(at(1_500), 8);
        assert_eq!(at(2_000), 16, "`late 1` whole");
        assert_eq!(at(9_000), 23, "nothing since");
        assert_eq!(since_offset(&p, &mut f, UNIX_EPOCH).unwrap(), 0);
    }
}
