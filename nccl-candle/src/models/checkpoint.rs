//! A Hugging Face checkpoint directory: `config.json`, the weights (`model.safetensors`, or
//! the shards `model.safetensors.index.json` lists) and `tokenizer.json`; what is in each
//! weights file, read from the files' headers alone.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::DType;

use super::config::ModelConfig;
use crate::{fingerprint, CheckpointFault, Error, Result};

/// The configuration's file name.
pub const CONFIG_FILE: &str = "config.json";
/// The weights of a checkpoint in one file.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The index of a checkpoint whose weights are sharded over several files.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The tokenizer's file name.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// Where one tensor is and what it is, from its file's header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// The file holding it.
    pub file: PathBuf,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its element type.
    pub dtype: DType,
    /// Where its data starts in the file, in bytes (after the header).
    pub offset: u64,
}

/// A checkpoint directory, opened: the configuration parsed and validated, the weights files
/// found (and those an index lists present), every tensor's file, shape and type read from
/// the headers. Nothing of the weights' data is read here.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    dir: PathBuf,
    config: ModelConfig,
    config_text: String,
    files: Vec<PathBuf>,
    tensors: BTreeMap<String, TensorInfo>,
}

fn fault(path: &Path, fault: CheckpointFault, why: impl Into<String>) -> Error {
    Error::Checkpoint {
        path: path.to_path_buf(),
        fault,
        why: why.into(),
    }
}

/// The most a JSON file of a checkpoint may hold (tokenizers run to tens of MB).
const MAX_JSON: u64 = 256 << 20;

/// A JSON file of the checkpoint, read whole: a regular file of at most [`MAX_JSON`] bytes
/// (not a device or a pipe a read would never end on).
fn read_text(path: &Path) -> Result<String> {
    let missing = |err: std::io::Error| {
        fault(
            path,
            CheckpointFault::Missing,
            format!("cannot read it: {err}"),
        )
    };
    let file = File::open(path).map_err(missing)?;
    let meta = file.metadata().map_err(missing)?;
    if !meta.is_file() || meta.len() > MAX_JSON {
        return Err(fault(
            path,
            CheckpointFault::Malformed,
            format!("not a regular file of at most {MAX_JSON} bytes"),
        ));
    }
    let mut text = String::new();
    file.take(MAX_JSON)
        .read_to_string(&mut text)
        .map_err(|err| {
            fault(
                path,
                CheckpointFault::Malformed,
                format!("not UTF-8 text: {err}"),
            )
        })?;
    Ok(text)
}

impl Checkpoint {
    /// Opens the checkpoint in `dir`. Refused with [`Error::Checkpoint`] naming the file: a
    /// missing or unreadable `config.json` or weights file ([`CheckpointFault::Missing`]),
    /// one that cannot be parsed, an index naming files outside the directory, a tensor in
    /// two files or in another file than the index says ([`CheckpointFault::Malformed`]), an
    /// architecture these models do not run ([`CheckpointFault::Unsupported`]).
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let config_path = dir.join(CONFIG_FILE);
        let config_text = read_text(&config_path)?;
        let config = ModelConfig::from_json(&config_text, &config_path)?;
        let index_path = dir.join(INDEX_FILE);
        // transformers loads model.safetensors when both are there.
        let (files, index) = if dir.join(WEIGHTS_FILE).exists() {
            (vec![dir.join(WEIGHTS_FILE)], None)
        } else if index_path.exists() {
            let index = read_index(&index_path)?;
            let mut files: Vec<PathBuf> = index.values().cloned().collect();
            files.sort();
            files.dedup();
            (
                files.into_iter().map(|f| dir.join(f)).collect(),
                Some(index),
            )
        } else {
            return Err(fault(
                &dir,
                CheckpointFault::Missing,
                format!("neither {WEIGHTS_FILE} nor {INDEX_FILE} is there"),
            ));
        };
        let mut tensors = BTreeMap::new();
        for file in &files {
            for (name, info) in read_header(file)? {
                if let Some(earlier) = tensors.insert(name.clone(), info) {
                    return Err(fault(
                        file,
                        CheckpointFault::Malformed,
                        format!("{name} is also in {}", earlier.file.display()),
                    ));
                }
            }
        }
        if let Some(index) = &index {
            for (name, listed) in index {
                let listed = dir.join(listed);
                match tensors.get(name) {
                    Some(info) if info.file == listed => {}
                    Some(info) => {
                        return Err(fault(
                            &index_path,
                            CheckpointFault::Malformed,
                            format!(
                                "{name} is listed in {} but is in {}",
                                listed.display(),
                                info.file.display()
                            ),
                        ))
                    }
                    None => {
                        return Err(fault(
                            &listed,
                            CheckpointFault::Tensor,
                            format!("{name}, which {INDEX_FILE} lists here, is not in the file"),
                        ))
                    }
                }
            }
        }
        Ok(Self {
            dir,
            config,
            config_text,
            files,
            tensors,
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The weights files.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// Every tensor of the weights files, by name.
    pub fn tensors(&self) -> &BTreeMap<String, TensorInfo> {
        &self.tensors
    }

    /// The bytes of the weights' data (what the headers describe).
    pub fn weight_bytes(&self) -> usize {
        // Each tensor's bytes lie in its file (checked when opened); saturating all the same.
        self.tensors
            .values()
            .map(|t| t.shape.iter().product::<usize>() * t.dtype.size_in_bytes())
            .fold(0usize, usize::saturating_add)
    }

    /// A fingerprint of the checkpoint for the ranks to compare
    /// ([`TpGroup::agree`](crate::tp::TpGroup::agree)): the configuration's text and every
    /// tensor's name, file, shape and type, plus each weights file's length and 4 KiB at 16
    /// places spread over it (a file rewritten with the same layout but other values is
    /// caught short of a change between those places). Reads 64 KiB a file.
    pub fn fingerprint(&self) -> Result<u64> {
        let mut samples = Vec::new();
        for file in &self.files {
            samples.push(sample(file)?);
        }
        let tensors: Vec<(&String, &Path, &Vec<usize>, String)> = self
            .tensors
            .iter()
            .map(|(name, t)| {
                let file = t.file.strip_prefix(&self.dir).unwrap_or(&t.file);
                (name, file, &t.shape, format!("{:?}", t.dtype))
            })
            .collect();
        Ok(fingerprint(&(&self.config_text, tensors, samples)))
    }

    /// The tokenizer of `tokenizer.json`: [`CheckpointFault::Missing`] when the file is not
    /// there, [`CheckpointFault::Malformed`] when the tokenizers crate cannot read it.
    pub fn tokenizer(&self) -> Result<tokenizers::Tokenizer> {
        let path = self.dir.join(TOKENIZER_FILE);
        let text = read_text(&path)?;
        text.parse::<tokenizers::Tokenizer>().map_err(|err| {
            fault(
                &path,
                CheckpointFault::Malformed,
                format!("not a tokenizer: {err}"),
            )
        })
    }

    /// Checks that the tensor `name` is there with `shape` and a floating-point type:
    /// [`CheckpointFault::Tensor`] naming it (and its file) otherwise.
    pub(crate) fn expect(&self, name: &str, shape: &[usize]) -> Result<()> {
        let Some(info) = self.tensors.get(name) else {
            let files: Vec<String> = self.files.iter().map(|f| f.display().to_string()).collect();
            return Err(fault(
                &self.dir,
                CheckpointFault::Tensor,
                format!(
                    "{name} is in none of the weights files ({})",
                    files.join(", ")
                ),
            ));
        };
        if info.shape != shape {
            return Err(fault(
                &info.file,
                CheckpointFault::Tensor,
                format!(
                    "{name} has shape {:?}, the configuration implies {shape:?}",
                    info.shape
                ),
            ));
        }
        if !matches!(info.dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(fault(
                &info.file,
                CheckpointFault::Tensor,
                format!("{name} holds {:?}, not f32, bf16 or f16", info.dtype),
            ));
        }
        Ok(())
    }

    /// Fills `buf` with tensor `name`'s data from byte `at` of it on, read from its file (a
    /// positioned read: a file changed since [`open`](Self::open) gives an error or other
    /// numbers, never memory the process does not own, as a mapping could).
    pub(crate) fn read_tensor_bytes(&self, name: &str, at: u64, buf: &mut [u8]) -> Result<()> {
        let info = self.tensors.get(name).ok_or_else(|| {
            fault(
                &self.dir,
                CheckpointFault::Tensor,
                format!("{name} is not in the checkpoint"),
            )
        })?;
        let end = at.checked_add(buf.len() as u64);
        let size = info.shape.iter().product::<usize>() * info.dtype.size_in_bytes();
        if end.is_none_or(|end| end > size as u64) {
            return Err(fault(
                &info.file,
                CheckpointFault::Tensor,
                format!("{name}: bytes {at}.. past its {size}"),
            ));
        }
        let cannot = |err: std::io::Error| {
            fault(
                &info.file,
                CheckpointFault::Missing,
                format!("cannot read {name}: {err} (did the file change since it was opened?)"),
            )
        };
        let mut file = File::open(&info.file).map_err(cannot)?;
        file.seek(SeekFrom::Start(info.offset + at))
            .map_err(cannot)?;
        file.read_exact(buf).map_err(cannot)
    }
}

/// The index's `weight_map`: tensor name → file name (relative, inside the directory).
fn read_index(path: &Path) -> Result<HashMap<String, PathBuf>> {
    let text = read_text(path)?;
    let malformed = |why: String| fault(path, CheckpointFault::Malformed, why);
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|err| malformed(format!("not JSON: {err}")))?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| malformed("no weight_map object".into()))?;
    let mut index = HashMap::with_capacity(map.len());
    for (name, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| malformed(format!("weight_map.{name}: not a file name")))?;
        let relative = Path::new(file);
        // Only plain names inside the directory: an index must not reach other files.
        let plain = relative.components().count() == 1
            && matches!(
                relative.components().next(),
                Some(std::path::Component::Normal(_))
            );
        if !plain {
            return Err(malformed(format!(
                "weight_map.{name}: {file:?} is not a file of the checkpoint's directory"
            )));
        }
        index.insert(name.clone(), relative.to_path_buf());
    }
    if index.is_empty() {
        return Err(malformed("weight_map lists no tensor".into()));
    }
    Ok(index)
}

/// A safetensors header's limit: larger ones are not headers (safetensors' own limit).
const MAX_HEADER: u64 = 100_000_000;

/// Every tensor of a safetensors file, from its header: its name, and its shape, type and
/// where its data starts.
fn read_header(path: &Path) -> Result<Vec<(String, TensorInfo)>> {
    let missing = |err: std::io::Error| {
        fault(
            path,
            CheckpointFault::Missing,
            format!("cannot read it: {err}"),
        )
    };
    let malformed = |why: String| fault(path, CheckpointFault::Malformed, why);
    let mut file = File::open(path).map_err(missing)?;
    let len = file.metadata().map_err(missing)?.len();
    let mut word = [0u8; 8];
    file.read_exact(&mut word)
        .map_err(|_| malformed("shorter than a safetensors header".into()))?;
    let header_len = u64::from_le_bytes(word);
    if header_len > MAX_HEADER || header_len > len.saturating_sub(8) {
        return Err(malformed(format!(
            "a header of {header_len} bytes in a file of {len}: not safetensors"
        )));
    }
    // Checked against MAX_HEADER above.
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header).map_err(missing)?;
    let value: serde_json::Value = serde_json::from_slice(&header)
        .map_err(|err| malformed(format!("the header is not JSON: {err}")))?;
    let entries = value
        .as_object()
        .ok_or_else(|| malformed("the header is not a JSON object".into()))?;
    let data_len = len - 8 - header_len;
    let mut out = Vec::with_capacity(entries.len());
    let mut spans = Vec::with_capacity(entries.len());
    for (name, entry) in entries {
        if name == "__metadata__" {
            continue;
        }
        let bad = |what: &str| malformed(format!("{name}: {what}"));
        let dtype = match entry.get("dtype").and_then(|d| d.as_str()) {
            Some("F32") => DType::F32,
            Some("BF16") => DType::BF16,
            Some("F16") => DType::F16,
            Some("F64") => DType::F64,
            Some("I64") => DType::I64,
            Some("U32") => DType::U32,
            Some("U8") => DType::U8,
            Some(other) => return Err(bad(&format!("element type {other} not supported"))),
            None => return Err(bad("no dtype")),
        };
        let shape: Vec<usize> = entry
            .get("shape")
            .and_then(|s| s.as_array())
            .and_then(|dims| {
                dims.iter()
                    .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
                    .collect()
            })
            .ok_or_else(|| bad("no shape"))?;
        let offsets: Vec<u64> = entry
            .get("data_offsets")
            .and_then(|o| o.as_array())
            .and_then(|o| o.iter().map(|v| v.as_u64()).collect())
            .ok_or_else(|| bad("no data_offsets"))?;
        let bytes = shape
            .iter()
            .try_fold(dtype.size_in_bytes(), |acc, &d| acc.checked_mul(d))
            .and_then(|b| u64::try_from(b).ok());
        let span = match (offsets.as_slice(), bytes) {
            ([start, end], Some(bytes)) if start <= end && end - start == bytes => (*start, *end),
            _ => return Err(bad("its data_offsets do not fit its shape")),
        };
        spans.push((span, name.clone()));
        // Within the file: the spans tile its data (checked below).
        out.push((
            name.clone(),
            TensorInfo {
                file: path.to_path_buf(),
                shape,
                dtype,
                offset: 8 + header_len + span.0,
            },
        ));
    }
    // safetensors' own rule: the tensors tile the data, no gap, no overlap, nothing after.
    spans.sort();
    let mut next = 0;
    for ((start, end), name) in &spans {
        if *start != next {
            return Err(malformed(format!(
                "{name}'s data starts at {start}, not at {next} where the one before ends"
            )));
        }
        next = *end;
    }
    if next != data_len {
        return Err(malformed(format!(
            "the tensors' data ends at {next}, the file's at {data_len}"
        )));
    }
    Ok(out)
}

/// A file's length and 4 KiB at 16 places spread over it.
fn sample(path: &Path) -> Result<(u64, Vec<u8>)> {
    let missing = |err: std::io::Error| {
        fault(
            path,
            CheckpointFault::Missing,
            format!("cannot read it: {err}"),
        )
    };
    let mut file = File::open(path).map_err(missing)?;
    let len = file.metadata().map_err(missing)?.len();
    let mut samples = Vec::new();
    let mut buf = vec![0u8; 4096];
    for i in 0..16u64 {
        let at = len.saturating_sub(4096) / 15 * i;
        file.seek(SeekFrom::Start(at)).map_err(missing)?;
        // Whole samples: a short read (network file systems) must not change the print.
        let n = usize::try_from((len - at).min(4096)).unwrap_or(4096);
        file.read_exact(&mut buf[..n]).map_err(missing)?;
        samples.extend_from_slice(&buf[..n]);
    }
    Ok((len, samples))
}
