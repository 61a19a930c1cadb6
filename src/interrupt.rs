//! Ctrl-C (SIGINT), for every command: one handler, installed by `main` at start-up, whose
//! effect each phase of a command chooses ([`set`]).
//!
//! By default a SIGINT deletes the staging folder of a compile in progress (so no `.staging-*`
//! is left in the cache) and ends the process with status 130. While `kiln run` generates, the
//! first one sets the cancel flag that generation checks before each token, so the text or JSON
//! so far is still printed, and a second one ends the process at once. During a `kiln chat`
//! reply every SIGINT stops the reply; at its prompt, a chat on a terminal ignores SIGINT (the
//! line editor reads Ctrl-C as a key) and a piped one ends.

use anyhow::{Context as _, Result};
use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

/// Exit status of a process ended by Ctrl-C: 128 + SIGINT, as a shell reports it.
pub const EXIT_STATUS: u8 = 130;

/// What the next SIGINT does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum OnInterrupt {
    /// Delete the staging folders of compiles in progress and exit with [`EXIT_STATUS`].
    Exit = 0,
    /// Nothing.
    Ignore = 1,
    /// Set the cancel flag, every time.
    Cancel = 2,
    /// Set the cancel flag; exit (as [`OnInterrupt::Exit`]) if it is already set.
    CancelThenExit = 3,
}

impl OnInterrupt {
    fn from_u8(v: u8) -> OnInterrupt {
        match v {
            1 => OnInterrupt::Ignore,
            2 => OnInterrupt::Cancel,
            3 => OnInterrupt::CancelThenExit,
            _ => OnInterrupt::Exit,
        }
    }
}

struct State {
    mode: AtomicU8,
    cancel: Arc<AtomicBool>,
}

fn state() -> &'static State {
    static STATE: OnceLock<State> = OnceLock::new();
    STATE.get_or_init(|| State {
        mode: AtomicU8::new(OnInterrupt::Exit as u8),
        cancel: Arc::new(AtomicBool::new(false)),
    })
}

/// Installs the handler (once per process), in mode [`OnInterrupt::Exit`].
pub fn install() -> Result<()> {
    let state = state();
    ctrlc::set_handler(move || handle(state)).context("installing the Ctrl-C handler")
}

/// Runs on the handler's own thread (not in signal context), once per SIGINT.
fn handle(state: &State) {
    match OnInterrupt::from_u8(state.mode.load(Ordering::SeqCst)) {
        OnInterrupt::Exit => exit_now(),
        OnInterrupt::Ignore => {}
        OnInterrupt::Cancel => state.cancel.store(true, Ordering::SeqCst),
        OnInterrupt::CancelThenExit => {
            if state.cancel.swap(true, Ordering::SeqCst) {
                exit_now();
            }
        }
    }
}

/// Chooses what the next SIGINT does; entering a mode that cancels clears the cancel flag.
pub fn set(mode: OnInterrupt) {
    let state = state();
    if matches!(mode, OnInterrupt::Cancel | OnInterrupt::CancelThenExit) {
        state.cancel.store(false, Ordering::SeqCst);
    }
    state.mode.store(mode as u8, Ordering::SeqCst);
}

/// The flag a SIGINT sets in the cancelling modes (for `GenerateOptions::cancel`).
pub fn cancel_flag() -> Arc<AtomicBool> {
    state().cancel.clone()
}

/// Runs `f` and then puts back the SIGINT disposition that was in place before it, so that a
/// library which takes SIGINT for itself cannot take Ctrl-C away from [`install`]'s handler.
///
/// rustyline's line editor (without its `signal-hook` feature, whose reader lost all but the
/// first byte of a line that arrived in one read) installs its own SIGINT handler when it is
/// created and keeps it until it is dropped; `kiln chat` would then no longer stop a reply on
/// Ctrl-C. At its prompt the editor reads Ctrl-C as a key (the terminal is in raw mode), so it
/// does not need the signal.
pub fn keeping_handler<T>(f: impl FnOnce() -> T) -> Result<T> {
    // SAFETY: `sigaction` with a null new action only reads the current one into `saved`, a
    // zeroed (valid) `sigaction` value owned by this frame.
    let saved = unsafe {
        let mut saved: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(libc::SIGINT, std::ptr::null(), &mut saved) != 0 {
            return Err(std::io::Error::last_os_error()).context("reading the SIGINT handler");
        }
        saved
    };
    let value = f();
    // SAFETY: puts back the action `sigaction` returned above, unchanged: the handler it names
    // (ctrlc's, or the default) is still installed code of this process.
    if unsafe { libc::sigaction(libc::SIGINT, &saved, std::ptr::null_mut()) } != 0 {
        return Err(std::io::Error::last_os_error()).context("restoring the SIGINT handler");
    }
    Ok(value)
}

/// Set once a SIGINT has begun to end the process ([`exit_now`]).
static EXITING: AtomicBool = AtomicBool::new(false);

/// Waits for the end of the process if a SIGINT is ending it: called by `main` before it
/// reports an error. Deleting a compile's staging folder makes the compile thread fail
/// ("No such file or directory" under `.objects`), and that error, reported and returned
/// with status 1 before the handler's thread reached `_exit(130)`, was what the process ended
/// with (`ctrl_c_during_a_compile_leaves_no_staging_folder`, now and then).
pub fn yield_to_exit() {
    if EXITING.load(Ordering::SeqCst) {
        loop {
            std::thread::park();
        }
    }
}

/// Ends the process now: the staging folders of compiles in progress are deleted first.
fn exit_now() -> ! {
    EXITING.store(true, Ordering::SeqCst);
    kiln_cache::remove_active_staging();
    // SAFETY: `_exit` ends the process without running atexit handlers or static destructors,
    // which could tear down LLVM under a compile thread that is still using it. Output written
    // so far has been flushed: every write of the CLI flushes (see `output`).
    unsafe { libc::_exit(i32::from(EXIT_STATUS)) }
}
