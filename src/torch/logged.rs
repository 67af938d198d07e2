//! PyTorch's error message where this torch does not hand it over.
//!
//! A call through PyTorch's C shim that throws returns an error code; newer torches keep the
//! exception's text for `torch_exception_get_what_without_backtrace` (2.15 does), but torch
//! 2.10 and 2.11 have no such getter and only log it to standard error (`Exception in aoti_torch: <message>`, then the C++
//! backtrace) and drop it. So where the getter is missing, a failed call of PyTorch's own
//! kernel is made once more with file descriptor 2 pointed at an in-memory file, and the
//! message is read back from what PyTorch logged: the `RuntimeError` the user gets then
//! carries PyTorch's own text, as on newer torches. Only failing calls pay for this (the
//! failure is in PyTorch's argument checks, which change nothing, so the second call fails
//! the same way); anything else written to standard error meanwhile (another thread's output)
//! is written back to it.

use std::sync::Mutex;

/// What PyTorch's shim writes before the exception's text.
const MARKER: &str = "Exception in aoti_torch: ";
/// What starts the C++ backtrace after the text (`c10::Error::what()`).
const BACKTRACE: &str = "Exception raised from ";

/// One capture at a time: descriptor 2 is the process's.
static CAPTURE: Mutex<()> = Mutex::new(());

/// Runs `call` with standard error captured; returns its result and PyTorch's logged exception
/// message, if it logged one. Everything else captured is written back to standard error.
/// Without a way to capture (no in-memory file), `call` runs as is and no message comes back.
pub fn capture<T>(call: impl FnOnce() -> T) -> (T, Option<String>) {
    let _one = CAPTURE.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: plain descriptor calls; every descriptor opened here is closed here, and fd 2 is
    // restored before returning.
    unsafe {
        let file = libc::memfd_create(c"mucudnn-stderr".as_ptr(), libc::MFD_CLOEXEC);
        if file < 0 {
            return (call(), None);
        }
        let saved = libc::dup(2);
        if saved < 0 || libc::dup2(file, 2) < 0 {
            if saved >= 0 {
                libc::close(saved);
            }
            libc::close(file);
            return (call(), None);
        }
        let result = call();
        libc::dup2(saved, 2);
        libc::close(saved);
        let text = read_all(file);
        libc::close(file);
        let (message, rest) = split(&text);
        if !rest.is_empty() {
            write_all(2, rest.as_bytes());
        }
        (result, message)
    }
}

unsafe fn read_all(file: i32) -> String {
    let mut bytes = Vec::new();
    let mut buffer = [0u8; 4096];
    // SAFETY: a descriptor this module opened; reads into a local buffer.
    unsafe {
        if libc::lseek(file, 0, libc::SEEK_SET) < 0 {
            return String::new();
        }
        loop {
            let n = libc::read(file, buffer.as_mut_ptr().cast(), buffer.len());
            if n <= 0 {
                break;
            }
            bytes.extend_from_slice(&buffer[..n as usize]);
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

fn write_all(fd: i32, mut bytes: &[u8]) {
    while !bytes.is_empty() {
        // SAFETY: writes from a live slice.
        let n = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
        if n <= 0 {
            return;
        }
        bytes = &bytes[n as usize..];
    }
}

/// PyTorch's message (without the log line's prefix and the backtrace) and the rest of the
/// captured text (before the log line, and after the backtrace's frames).
pub fn split(text: &str) -> (Option<String>, String) {
    let Some(at) = text.find(MARKER) else {
        return (None, text.to_string());
    };
    let line_start = text[..at].rfind('\n').map_or(0, |i| i + 1);
    let before = &text[..line_start];
    let after = &text[at + MARKER.len()..];
    let mut message = Vec::new();
    let mut lines = after.split_inclusive('\n').peekable();
    while let Some(line) = lines.peek() {
        if line.starts_with(BACKTRACE) {
            break;
        }
        message.push(*line);
        lines.next();
    }
    if lines.peek().is_some_and(|l| l.starts_with(BACKTRACE)) {
        lines.next();
        while lines
            .peek()
            .is_some_and(|l| l.starts_with("frame #") || l.starts_with("<omitting"))
        {
            lines.next();
        }
    }
    let message = message.concat().trim_end().to_string();
    let rest = format!("{before}{}", lines.collect::<String>());
    ((!message.is_empty()).then_some(message), rest)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOGGED: &str = "other thread\n[E1129 06:42:22.938728556 c_shim_cpu.cpp:744] \
        Exception in aoti_torch: Given weight of size [4, 3, 3, 3], expected bias to be \
        1-dimensional with 4 elements, but got bias of size [5] instead\n\
        Exception raised from check_shape_forward at Convolution.cpp:673 (most recent call \
        first):\nframe #0: c10::Error::Error + 0x1\nframe #1: at::native::f + 0x2\n\
        <omitting python frames>\nlater line\n";

    #[test]
    fn the_message_is_cut_from_the_log_line_and_the_backtrace() {
        let (message, rest) = split(LOGGED);
        assert_eq!(
            message.as_deref(),
            Some(
                "Given weight of size [4, 3, 3, 3], expected bias to be 1-dimensional with 4 \
                 elements, but got bias of size [5] instead"
            )
        );
        assert_eq!(rest, "other thread\nlater line\n");
    }

    #[test]
    fn a_message_of_several_lines_and_no_backtrace() {
        let (message, rest) = split("[E] Exception in aoti_torch: first\nsecond\n");
        assert_eq!(message.as_deref(), Some("first\nsecond"));
        assert_eq!(rest, "");
        let (message, rest) = split("nothing of PyTorch's\n");
        assert_eq!(message, None);
        assert_eq!(rest, "nothing of PyTorch's\n");
    }

    #[test]
    fn what_is_written_to_descriptor_2_is_captured_and_the_rest_given_back() {
        let (value, message) = capture(|| {
            write_all(
                2,
                b"[E x] Exception in aoti_torch: bad stride\nException raised from f\n",
            );
            7
        });
        assert_eq!(value, 7);
        assert_eq!(message.as_deref(), Some("bad stride"));
        // Descriptor 2 is standard error again (writable, not the closed in-memory file).
        // SAFETY: a flag query on a descriptor.
        assert!(unsafe { libc::fcntl(2, libc::F_GETFD) } >= 0);
    }
}
