//! Processes a test starts (`orders serve`, `oncely sim`, `localstripe`, …), tied to the
//! life of the test binary, so that nothing a test started outlives it:
//! - on a failed assertion or panic the test's own guard (a `Drop` that kills its child)
//!   stops the process;
//! - when the test binary itself dies without unwinding (`cargo test` interrupted, the
//!   binary SIGKILLed, a timeout), Linux's parent-death signal does: every child is started
//!   as `setpriv --pdeathsig KILL -- PROGRAM …`, so the kernel sends it SIGKILL when the
//!   thread that forked it exits.
//!
//! The parent-death signal follows the *thread* that forked, not the process
//! (`prctl(2)`, `PR_SET_PDEATHSIG`). A child forked from a tokio blocking thread would be
//! killed when that thread idles out, mid-test; so every spawn goes through one spawner
//! thread that lives as long as the test binary ([`spawn`]).
//!
//! `setpriv` (util-linux) is used instead of a `pre_exec` hook calling `prctl` because the
//! workspace forbids `unsafe` code; it execs the program in place, so the child's pid is
//! the program's own.

use std::ffi::OsStr;
use std::io;
use std::process::{Child, Command};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};

/// A command that runs `program` with the parent-death signal set to SIGKILL. Add
/// arguments, environment and stdio as on any [`Command`], then start it with [`spawn`]
/// (or [`SpawnTied::spawn_tied`]).
#[must_use]
pub fn command(program: impl AsRef<OsStr>) -> Command {
    let mut c = Command::new("setpriv");
    c.arg("--pdeathsig").arg("KILL").arg("--").arg(program);
    c
}

/// A request to the spawner thread: the command, and where to send the child.
type Request = (Command, mpsc::Sender<io::Result<Child>>);

/// The spawner thread's inbox; the thread is started on first use and runs until the
/// test binary exits.
fn spawner() -> &'static Mutex<mpsc::Sender<Request>> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<Request>>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Request>();
        std::thread::Builder::new()
            .name("oncely-test-spawner".to_owned())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    drop(reply.send(cmd.spawn()));
                }
            })
            .expect("start the test spawner thread");
        Mutex::new(tx)
    })
}

/// Starts `cmd` from the long-lived spawner thread, so its parent-death signal fires only
/// when the test binary exits.
///
/// # Errors
/// The error of [`Command::spawn`] (the program is missing, say).
pub fn spawn(cmd: Command) -> io::Result<Child> {
    let (reply, answer) = mpsc::channel();
    spawner()
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .send((cmd, reply))
        .map_err(|_| io::Error::other("the test spawner thread is gone"))?;
    answer
        .recv()
        .map_err(|_| io::Error::other("the test spawner thread is gone"))?
}

/// [`spawn`] as a method, for builder chains: `command(bin).arg(…).spawn_tied()`.
pub trait SpawnTied {
    /// Starts the command through [`spawn`].
    ///
    /// # Errors
    /// As [`spawn`].
    fn spawn_tied(&mut self) -> io::Result<Child>;
}

impl SpawnTied for Command {
    fn spawn_tied(&mut self) -> io::Result<Child> {
        spawn(std::mem::replace(self, Command::new("true")))
    }
}

/// A child that is killed (SIGKILL) and reaped when the guard drops: on a panic, a failed
/// assertion or the test's end.
#[derive(Debug)]
pub struct ProcessGuard {
    /// The process; tests may signal, wait on or read it.
    pub child: Child,
}

impl ProcessGuard {
    /// Starts `cmd` (built with [`command`]) through [`spawn`] and guards it.
    ///
    /// # Errors
    /// As [`spawn`].
    pub fn spawn(cmd: Command) -> io::Result<Self> {
        spawn(cmd).map(|child| Self { child })
    }

    /// The process id.
    #[must_use]
    pub fn id(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for ProcessGuard {
    fn drop(&mut self) {
        drop(self.child.kill());
        drop(self.child.wait());
    }
}

/// Runs `clean_up` to its end, or for at most 10 s, on a thread with a runtime of its own,
/// and waits for it: for a `Drop` that must do I/O (drop a schema, delete a stream). A
/// `Drop` cannot await, and the runtime it is dropped on is the one it would block.
/// Best-effort: a runtime that cannot be built, or a timeout, leaves the object behind.
pub fn clean_up_blocking<F>(clean_up: F)
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let worker = std::thread::spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        rt.block_on(async move {
            drop(tokio::time::timeout(std::time::Duration::from_secs(10), clean_up).await);
        });
    });
    drop(worker.join());
}
