//! Socket reads and writes bounded by a deadline, so that no peer can stretch a wait.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::bootstrap::util::time_left;

/// Why a deadline-bounded read or write stopped short.
#[derive(Debug)]
pub(super) enum Short {
    /// The peer closed the connection (or took no more bytes) after `got` bytes.
    Eof { got: usize },
    /// The deadline passed after `got` bytes.
    TimedOut { got: usize },
    /// Any other socket error.
    Io(io::Error),
}

/// Fills `buf` from `stream`, giving up at `deadline`. Each read gets the time that is left, so
/// a peer that trickles one byte at a time cannot stretch the wait.
pub(super) fn read_full(
    stream: &TcpStream,
    buf: &mut [u8],
    deadline: Instant,
) -> Result<(), Short> {
    let timeout = |left| stream.set_read_timeout(Some(left));
    transfer(buf.len(), deadline, timeout, |done| {
        (&*stream).read(&mut buf[done..])
    })
}

/// Writes all of `bytes` to `stream`, giving up at `deadline`.
pub(super) fn write_full(stream: &TcpStream, bytes: &[u8], deadline: Instant) -> io::Result<()> {
    let timeout = |left| stream.set_write_timeout(Some(left));
    let written = transfer(bytes.len(), deadline, timeout, |done| {
        (&*stream).write(&bytes[done..])
    });
    written.map_err(|short| match short {
        Short::Eof { .. } => io::ErrorKind::WriteZero.into(),
        Short::TimedOut { got } => io::Error::new(
            io::ErrorKind::TimedOut,
            format!("write timed out after {got} of {} bytes", bytes.len()),
        ),
        Short::Io(e) => e,
    })
}

/// Moves `len` bytes by calls of `step` (given the bytes done so far), each under the time
/// left until `deadline`.
fn transfer(
    len: usize,
    deadline: Instant,
    set_timeout: impl Fn(Duration) -> io::Result<()>,
    mut step: impl FnMut(usize) -> io::Result<usize>,
) -> Result<(), Short> {
    let mut done = 0;
    while done < len {
        let Some(left) = time_left(deadline) else {
            return Err(Short::TimedOut { got: done });
        };
        set_timeout(left).map_err(Short::Io)?;
        match step(done) {
            Ok(0) => return Err(Short::Eof { got: done }),
            Ok(n) => done += n,
            // A timed-out call reports WouldBlock (Unix) or TimedOut (Windows); the deadline
            // check at the top of the loop decides whether that was final.
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::Interrupted
                        | io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(Short::Io(e)),
        }
    }
    Ok(())
}
