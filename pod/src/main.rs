//! `ramify-pod [--dir /ramify] [--move-wait]`: the one container of a Sandbox's Pod in
//! cluster mode (see `ramify_crds::pod`). It follows the sandbox's console, which the
//! node agent appends to `<dir>/console.log` (like `tail -F`: the file may not exist
//! yet), onto its own stdout, so `kubectl logs` shows it; when the agent has written
//! `<dir>/exit`, it copies what is left of the console and exits with that code, so the
//! Pod's phase follows the sandbox's. SIGTERM and SIGINT end it at once (143, 130).
//!
//! With `--move-wait` (a workspace's Pod), told to stop it first looks for
//! `<dir>/moving` for up to 2 s: the node agent writes it when the Pod is evicted and it
//! moves the workspace (checkpoints it, to resume in a new Pod). Then it waits for the
//! exit file, which the agent writes once the checkpoint is taken: the sandbox lives in
//! this Pod's cgroup and network namespace until then. When the agent is down (its
//! heartbeat in `<dir>/agent-alive` is stale), it waits for the agent to come back and
//! decide, rather than end the Pod and the workspace in it. The Pod's grace period
//! bounds every wait.
//!
//! The Pod must not end before its sandbox does: a console that cannot be read is said
//! on stderr and looked at again, never fatal.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use ramify_crds::pod::{
    POD_ARG_MOVE_WAIT, POD_CONSOLE_FILE, POD_EXIT_FILE, POD_HEARTBEAT_FILE,
    POD_HEARTBEAT_STALE_SECONDS, POD_MOUNT, POD_MOVE_LINGER_AFTER_RETURN_MILLIS,
    POD_MOVE_LINGER_MILLIS, POD_MOVING_FILE,
};
use tokio::signal::unix::{SignalKind, signal};

/// How often the console and the exit file are looked at.
const POLL: Duration = Duration::from_millis(100);
/// Exit code of an exit file that does not hold one.
const BAD_EXIT_FILE: u8 = 1;
const USAGE: &str = "usage: ramify-pod [--dir DIR] [--move-wait]   (default DIR: /ramify)";

/// Follows one append-only file from where it last stopped.
struct Follower {
    path: PathBuf,
    offset: u64,
}

impl Follower {
    fn new(path: PathBuf) -> Self {
        Self { path, offset: 0 }
    }

    /// Copies what was appended since the last call to `out`; a file that does not exist
    /// (yet) has nothing to copy. A file shorter than what was copied was replaced or
    /// truncated: it is followed again from its start, as `tail -F` does.
    fn pump(&mut self, out: &mut impl Write) -> io::Result<u64> {
        let mut file = match File::open(&self.path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(e),
        };
        if file.metadata()?.len() < self.offset {
            self.offset = 0;
        }
        file.seek(SeekFrom::Start(self.offset))?;
        let mut buf = [0u8; 64 * 1024];
        let mut copied = 0;
        loop {
            let n = match file.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            out.write_all(&buf[..n])?;
            self.offset += n as u64;
            copied += n as u64;
        }
        out.flush()?;
        Ok(copied)
    }
}

/// The exit code an exit file holds: decimal 0..=255, surrounding whitespace allowed.
fn parse_exit(text: &str) -> Result<u8, String> {
    let t = text.trim();
    t.parse::<u8>()
        .map_err(|_| format!("the exit file holds {t:?}, not an exit code (0..=255)"))
}

/// What one look at the directory found.
#[derive(Debug, PartialEq, Eq)]
enum Look {
    /// The sandbox still runs.
    Running,
    /// The sandbox ended; the console has been copied to its end.
    Exited(u8),
}

/// The console and the exit file of one sandbox.
struct Watch {
    console: Follower,
    exit: PathBuf,
    /// The last problem said on stderr (each is said once, not every poll).
    last_error: Option<String>,
}

impl Watch {
    fn new(dir: &Path) -> Self {
        Self {
            console: Follower::new(dir.join(POD_CONSOLE_FILE)),
            exit: dir.join(POD_EXIT_FILE),
            last_error: None,
        }
    }

    /// One look: the exit file first, then the console, so that everything the agent
    /// wrote before it wrote the exit file is copied before the exit.
    fn look(&mut self, out: &mut impl Write, err: &mut impl Write) -> Look {
        let exit = match std::fs::read_to_string(&self.exit) {
            Ok(text) => Some(text),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => {
                self.say(err, format!("reading {}: {e}", self.exit.display()));
                None
            }
        };
        self.copy(out, err);
        match exit.map(|t| parse_exit(&t)) {
            None => Look::Running,
            Some(Ok(code)) => Look::Exited(code),
            Some(Err(msg)) => {
                let _ = writeln!(err, "ramify-pod: {}: {msg}", self.exit.display());
                Look::Exited(BAD_EXIT_FILE)
            }
        }
    }

    /// Copies what is new in the console, saying (once) why when it cannot.
    fn copy(&mut self, out: &mut impl Write, err: &mut impl Write) {
        match self.console.pump(out) {
            Ok(_) => self.last_error = None,
            Err(e) => {
                let msg = format!("following {}: {e}", self.console.path.display());
                self.say(err, msg);
            }
        }
    }

    fn say(&mut self, err: &mut impl Write, msg: String) {
        if self.last_error.as_deref() != Some(msg.as_str()) {
            let _ = writeln!(err, "ramify-pod: {msg}");
            self.last_error = Some(msg);
        }
    }
}

/// What the command line asks.
#[derive(Debug, PartialEq, Eq)]
struct Args {
    dir: PathBuf,
    move_wait: bool,
}

/// `--dir DIR` or `--dir=DIR`, and `--move-wait`; nothing else.
fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Args, String> {
    let mut dir = PathBuf::from(POD_MOUNT);
    let mut move_wait = false;
    let mut args = args.into_iter();
    while let Some(a) = args.next() {
        if a == "--dir" {
            dir = args.next().ok_or("--dir needs a value")?.into();
        } else if let Some(v) = a.strip_prefix("--dir=") {
            dir = v.into();
        } else if a == POD_ARG_MOVE_WAIT {
            move_wait = true;
        } else {
            return Err(format!("unexpected argument {a:?}"));
        }
    }
    Ok(Args { dir, move_wait })
}

async fn follow(args: &Args) -> io::Result<u8> {
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut watch = Watch::new(&args.dir);
    let (mut out, mut err) = (io::stdout(), io::stderr());
    loop {
        if let Look::Exited(code) = watch.look(&mut out.lock(), &mut err) {
            return Ok(code);
        }
        let signalled = tokio::select! {
            _ = tokio::time::sleep(POLL) => None,
            _ = term.recv() => Some(143),
            _ = int.recv() => Some(130),
        };
        if let Some(code) = signalled {
            // What the console has now, then at once: the kubelet is stopping the Pod.
            watch.copy(&mut out, &mut err);
            if !args.move_wait {
                return Ok(code);
            }
            let linger = Linger {
                first: Duration::from_millis(POD_MOVE_LINGER_MILLIS),
                after_return: Duration::from_millis(POD_MOVE_LINGER_AFTER_RETURN_MILLIS),
                stale: Duration::from_secs(POD_HEARTBEAT_STALE_SECONDS),
            };
            return Ok(
                exit_after_stop(&mut watch, &args.dir, code, &linger, &mut out, &mut err).await,
            );
        }
    }
}

/// How long a stopped `ramify-pod --move-wait` gives the node agent to say its
/// sandbox moves.
struct Linger {
    /// From the stop, the agent being up.
    first: Duration,
    /// From the agent's return, when it was down.
    after_return: Duration,
    /// A heartbeat older than this: the agent is down.
    stale: Duration,
}

/// Whether the node agent's heartbeat in `dir` is older than `stale` (a Pod without
/// one holds no sandbox of a running agent: nothing to wait for).
fn agent_away(dir: &Path, stale: Duration) -> bool {
    std::fs::metadata(dir.join(POD_HEARTBEAT_FILE))
        .and_then(|m| m.modified())
        .is_ok_and(|t| t.elapsed().is_ok_and(|age| age > stale))
}

/// Told to stop (`signalled`: the code to exit with): a sandbox that moves (the node
/// agent wrote [`POD_MOVING_FILE`] within the linger) is waited for until its exit
/// file says it left this Pod; otherwise the Pod ends once the linger is over. While
/// the agent is down the linger does not run out: it starts again when it is back.
async fn exit_after_stop(
    watch: &mut Watch,
    dir: &Path,
    signalled: u8,
    linger: &Linger,
    out: &mut impl Write,
    err: &mut impl Write,
) -> u8 {
    let moving = dir.join(POD_MOVING_FILE);
    let mut until = tokio::time::Instant::now() + linger.first;
    let (mut said, mut away) = (false, false);
    loop {
        if let Look::Exited(code) = watch.look(out, err) {
            return code;
        }
        if moving.exists() {
            if !said {
                let _ = writeln!(
                    err,
                    "ramify-pod: the sandbox is moving to a new Pod: waiting for its checkpoint"
                );
                said = true;
            }
        } else if agent_away(dir, linger.stale) {
            if !away {
                let _ = writeln!(
                    err,
                    "ramify-pod: the node agent is down: waiting for it to come back and move the sandbox"
                );
                away = true;
            }
        } else if away {
            away = false;
            until = tokio::time::Instant::now() + linger.after_return;
        } else if tokio::time::Instant::now() >= until {
            return signalled;
        }
        tokio::time::sleep(POLL).await;
    }
}

fn main() -> ExitCode {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("ramify-pod: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("ramify-pod: starting: {e}");
            return ExitCode::from(BAD_EXIT_FILE);
        }
    };
    match rt.block_on(follow(&args)) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("ramify-pod: {e}");
            ExitCode::from(BAD_EXIT_FILE)
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn append(path: &Path, text: &str) {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap();
        f.write_all(text.as_bytes()).unwrap();
    }

    fn look(w: &mut Watch) -> (Look, String, String) {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let l = w.look(&mut out, &mut err);
        (
            l,
            String::from_utf8(out).unwrap(),
            String::from_utf8(err).unwrap(),
        )
    }

    #[test]
    fn follows_a_console_that_appears_later_and_exits_with_its_code() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = Watch::new(dir.path());
        assert_eq!(look(&mut w), (Look::Running, String::new(), String::new()));
        append(&dir.path().join(POD_CONSOLE_FILE), "one\n");
        assert_eq!(look(&mut w).1, "one\n");
        assert_eq!(look(&mut w).1, "", "nothing new, nothing copied");
        append(&dir.path().join(POD_CONSOLE_FILE), "two\nthr");
        assert_eq!(look(&mut w), (Look::Running, "two\nthr".into(), "".into()));
        // The rest of the console is copied before the exit.
        append(&dir.path().join(POD_CONSOLE_FILE), "ee\nlast\n");
        std::fs::write(dir.path().join(POD_EXIT_FILE), "42\n").unwrap();
        assert_eq!(
            look(&mut w),
            (Look::Exited(42), "ee\nlast\n".into(), "".into())
        );
    }

    #[test]
    fn exits_without_a_console() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(POD_EXIT_FILE), "0").unwrap();
        assert_eq!(
            look(&mut Watch::new(dir.path())),
            (Look::Exited(0), String::new(), String::new())
        );
    }

    #[test]
    fn an_exit_file_without_a_code_exits_1_saying_so() {
        for text in ["", "256", "-1", "done", "1 2"] {
            let dir = tempfile::tempdir().unwrap();
            std::fs::write(dir.path().join(POD_EXIT_FILE), text).unwrap();
            let (l, _, err) = look(&mut Watch::new(dir.path()));
            assert_eq!(l, Look::Exited(1), "{text:?}");
            assert!(err.contains("not an exit code"), "{text:?}: {err}");
        }
        assert_eq!(parse_exit(" 255\n"), Ok(255));
    }

    #[test]
    fn a_truncated_console_is_followed_from_its_start() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(POD_CONSOLE_FILE);
        let mut f = Follower::new(path.clone());
        std::fs::write(&path, "a long first line\n").unwrap();
        let mut out = Vec::new();
        f.pump(&mut out).unwrap();
        std::fs::write(&path, "new\n").unwrap();
        f.pump(&mut out).unwrap();
        assert_eq!(out, b"a long first line\nnew\n");
    }

    #[test]
    fn an_unreadable_console_is_said_once_and_never_ends_the_pod() {
        let dir = tempfile::tempdir().unwrap();
        // A directory where the console should be: reading it fails.
        std::fs::create_dir(dir.path().join(POD_CONSOLE_FILE)).unwrap();
        let mut w = Watch::new(dir.path());
        let (l, _, err) = look(&mut w);
        assert_eq!(l, Look::Running);
        assert!(err.contains("following"), "{err}");
        assert_eq!(look(&mut w), (Look::Running, String::new(), String::new()));
    }

    #[test]
    fn arguments() {
        let args = |a: &[&str]| parse_args(a.iter().map(|s| s.to_string()));
        let at = |d: &str, move_wait| {
            Ok(Args {
                dir: PathBuf::from(d),
                move_wait,
            })
        };
        assert_eq!(args(&[]), at("/ramify", false));
        assert_eq!(args(&["--dir", "/x"]), at("/x", false));
        assert_eq!(args(&["--dir=/y", "--move-wait"]), at("/y", true));
        assert!(args(&["--dir"]).is_err());
        assert!(args(&["/z"]).is_err());
    }

    #[tokio::test]
    async fn follow_returns_the_exit_code() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(POD_EXIT_FILE), "7").unwrap();
        let args = Args {
            dir: dir.path().into(),
            move_wait: true,
        };
        assert_eq!(follow(&args).await.unwrap(), 7);
    }

    #[tokio::test]
    async fn a_stopped_pod_waits_only_for_a_moving_sandbox() {
        let linger = Duration::from_millis(300);
        let stop = |dir: PathBuf| async move {
            let mut w = Watch::new(&dir);
            let (mut out, mut err) = (Vec::new(), Vec::new());
            let t0 = std::time::Instant::now();
            let l = Linger {
                first: linger,
                after_return: linger,
                stale: Duration::from_secs(15),
            };
            let code = exit_after_stop(&mut w, &dir, 143, &l, &mut out, &mut err).await;
            (code, t0.elapsed(), String::from_utf8(err).unwrap())
        };
        // Nothing moves: it ends with the signal's code once the linger is over.
        let still = tempfile::tempdir().unwrap();
        let (code, took, _) = stop(still.path().into()).await;
        assert_eq!(code, 143);
        assert!(took >= linger && took < linger * 4, "{took:?}");
        // Moving: it waits past the linger for the exit file, and exits with its code.
        let moving = tempfile::tempdir().unwrap();
        std::fs::write(moving.path().join(POD_MOVING_FILE), "").unwrap();
        let exit = moving.path().join(POD_EXIT_FILE);
        let writer = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(900)).await;
            std::fs::write(exit, "0").unwrap();
        });
        let (code, took, err) = stop(moving.path().into()).await;
        writer.await.unwrap();
        assert_eq!(code, 0);
        assert!(took >= Duration::from_millis(900), "{took:?}");
        assert!(err.contains("moving to a new Pod"), "{err}");
        // Ended already: its own code at once.
        let ended = tempfile::tempdir().unwrap();
        std::fs::write(ended.path().join(POD_EXIT_FILE), "3").unwrap();
        let (code, took, _) = stop(ended.path().into()).await;
        assert_eq!(code, 3);
        assert!(took < linger, "{took:?}");
    }

    #[tokio::test]
    async fn a_stopped_pod_waits_for_a_node_agent_that_is_down_to_come_back_and_decide() {
        let l = Linger {
            first: Duration::from_millis(200),
            after_return: Duration::from_millis(600),
            stale: Duration::from_secs(2),
        };
        let dir = tempfile::tempdir().unwrap();
        let beat = dir.path().join(POD_HEARTBEAT_FILE);
        // The agent's last heartbeat was 10 s ago: it is down.
        let old = std::time::SystemTime::now() - Duration::from_secs(10);
        std::fs::File::create(&beat)
            .unwrap()
            .set_modified(old)
            .unwrap();
        let (d, b) = (dir.path().to_path_buf(), beat.clone());
        // It comes back after 1 s (a fresh heartbeat) and says it moves 400 ms later,
        // then takes its checkpoint.
        let agent = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            std::fs::write(&b, "1").unwrap();
            tokio::time::sleep(Duration::from_millis(400)).await;
            std::fs::write(d.join(POD_MOVING_FILE), "").unwrap();
            tokio::time::sleep(Duration::from_millis(300)).await;
            std::fs::write(d.join(POD_EXIT_FILE), "0").unwrap();
        });
        let mut w = Watch::new(dir.path());
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let t0 = std::time::Instant::now();
        let code = exit_after_stop(&mut w, dir.path(), 143, &l, &mut out, &mut err).await;
        agent.await.unwrap();
        let err = String::from_utf8(err).unwrap();
        assert_eq!(code, 0, "{err}");
        assert!(
            t0.elapsed() >= Duration::from_millis(1700),
            "{:?}",
            t0.elapsed()
        );
        assert!(err.contains("node agent is down"), "{err}");
        assert!(err.contains("moving to a new Pod"), "{err}");

        // Back, it does not move the sandbox: the Pod ends once the linger after the
        // return is over.
        let dir = tempfile::tempdir().unwrap();
        let beat = dir.path().join(POD_HEARTBEAT_FILE);
        std::fs::File::create(&beat)
            .unwrap()
            .set_modified(old)
            .unwrap();
        let b = beat.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(500)).await;
            std::fs::write(&b, "1").unwrap();
        });
        let mut w = Watch::new(dir.path());
        let t0 = std::time::Instant::now();
        let code = exit_after_stop(&mut w, dir.path(), 143, &l, &mut out, &mut Vec::new()).await;
        assert_eq!(code, 143);
        let took = t0.elapsed();
        assert!(
            took >= Duration::from_millis(1100) && took < Duration::from_secs(3),
            "{took:?}"
        );
    }
}
