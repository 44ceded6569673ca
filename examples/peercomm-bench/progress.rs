//! The progress of a sweep, on stderr, on every run (host and GPU): a bar redrawn in
//! place (indicatif) when stderr is a terminal; otherwise (a log file, CI) a plain line
//! at every tenth of the points and at least every 30 seconds, so a log shows that the
//! run is alive and how far it got. Stdout keeps the measurements only.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

/// How often a line is printed at the least when stderr is not a terminal.
const LINE_EVERY: Duration = Duration::from_secs(30);

pub struct Progress {
    /// The bar, when stderr is a terminal.
    bar: Option<ProgressBar>,
    what: String,
    total: usize,
    done: usize,
    message: String,
    start: Instant,
    last_line: Instant,
    /// The tenths of `total` already reported by a line.
    tenths_reported: usize,
}

impl Progress {
    /// A sweep of `total` points; `what` names it ("all-reduce sweep").
    pub fn new(total: usize, what: &str) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new(total as u64).with_prefix(what.to_string());
            bar.set_style(
                ProgressStyle::with_template(
                    "{prefix} [{bar:30}] {pos}/{len} points, {elapsed} {msg}",
                )
                .expect("a valid template")
                .progress_chars("=> "),
            );
            bar
        });
        if bar.is_none() {
            eprintln!("progress: {what}: {total} points");
        }
        let now = Instant::now();
        Progress {
            bar,
            what: what.to_string(),
            total,
            done: 0,
            message: String::new(),
            start: now,
            last_line: now,
            tenths_reported: 0,
        }
    }

    /// What is being measured now ("bf16 group 2 64 KiB").
    pub fn set_message(&mut self, message: String) {
        if let Some(bar) = &self.bar {
            bar.set_message(message.clone());
        }
        self.message = message;
    }

    /// One point done.
    pub fn inc(&mut self) {
        self.done += 1;
        if let Some(bar) = &self.bar {
            bar.inc(1);
            return;
        }
        let tenths = (self.done * 10).checked_div(self.total).unwrap_or(10);
        if tenths > self.tenths_reported || self.last_line.elapsed() >= LINE_EVERY {
            self.tenths_reported = tenths;
            self.line();
        }
    }

    /// Runs `f` (which prints to stdout) with the bar cleared from the terminal.
    pub fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        match &self.bar {
            Some(bar) => bar.suspend(f),
            None => f(),
        }
    }

    /// The sweep is over: the bar is cleared, or a closing line printed.
    pub fn finish(self) {
        match &self.bar {
            Some(bar) => bar.finish_and_clear(),
            None if self.tenths_reported < 10 => self.line_final(),
            None => {}
        }
    }

    fn line(&mut self) {
        self.last_line = Instant::now();
        self.line_final();
    }

    fn line_final(&self) {
        let percent = (self.done * 100).checked_div(self.total).unwrap_or(100);
        eprintln!(
            "progress: {}: {}/{} points ({percent}%), {:.1} s{}",
            self.what,
            self.done,
            self.total,
            self.start.elapsed().as_secs_f64(),
            if self.message.is_empty() {
                String::new()
            } else {
                format!(", last: {}", self.message)
            }
        );
    }
}
