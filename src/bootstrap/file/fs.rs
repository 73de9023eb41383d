//! File operations the rendezvous needs: atomic writes, small reads, quiet removal, owners.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use crate::bootstrap::util::random_u64;

/// The user id of `file`'s owner, where the platform has one.
#[cfg(unix)]
pub(super) fn owner(file: &File) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    file.metadata().ok().map(|meta| meta.uid())
}

#[cfg(not(unix))]
pub(super) fn owner(_file: &File) -> Option<u32> {
    None
}

/// Reads at most `len + 1` bytes of `from`: one more than a valid file, to notice overlong
/// ones without reading them whole.
pub(super) fn read_small(from: impl Read, len: usize) -> io::Result<Vec<u8>> {
    let mut bytes = Vec::with_capacity(len + 1);
    from.take(len as u64 + 1).read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// Reads the file at `path`, expected to be `len` bytes (see [`read_small`]).
pub(super) fn read_small_file(path: &Path, len: usize) -> io::Result<Vec<u8>> {
    read_small(File::open(path)?, len)
}

/// Writes `bytes` to `path` so that readers see either the old file or the complete new one:
/// a unique temporary file in the same directory, synced, then renamed over `path`.
pub(super) fn write_atomically(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut temp_name = path.as_os_str().to_owned();
    temp_name.push(format!(".tmp.{}.{:016x}", std::process::id(), random_u64()));
    let temp = PathBuf::from(temp_name);
    if let Err(e) = write_synced(&temp, bytes).and_then(|()| fs::rename(&temp, path)) {
        remove_quietly(&temp);
        return Err(e);
    }
    // Persist the rename itself; not every platform can sync a directory, which is harmless
    // for a rendezvous that lives as long as the job.
    if let Some(dir) = path.parent() {
        if let Ok(dir) = File::open(dir) {
            let _ = dir.sync_all();
        }
    }
    Ok(())
}

/// Creates `path` (which must not exist), readable by this user only, with `bytes`, synced.
fn write_synced(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut options = OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        // The id lets a process join the communicator: keep it to this user.
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options.open(path)?;
    file.write_all(bytes)?;
    file.sync_all()
}

/// Removes a file, ignoring failures: cleanup must not turn a finished exchange into an error.
pub(super) fn remove_quietly(path: &Path) {
    let _ = fs::remove_file(path);
}
