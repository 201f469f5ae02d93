//! Safetensors checkpoints (single file or sharded through `model.safetensors.index.json`),
//! memory mapped with memmap2. Headers are validated when a file is opened (a truncated or
//! corrupt file is an error, never a crash); every lookup names the tensor and the file.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::SafeTensors;
use serde::Deserialize;

use crate::error::{Error, Result};

/// Element types this crate reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    Bf16,
    F16,
    F32,
    /// `float8_e4m3fn` (ModelOpt FP8 weights, with a per-tensor `weight_scale`; NVFP4 block
    /// scales).
    F8E4M3,
    /// Bytes: ModelOpt NVFP4 weights, two e2m1 codes a byte (`crate::nvfp4`).
    U8,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::F32 => 4,
            Dtype::F8E4M3 | Dtype::U8 => 1,
        }
    }
}

/// Where one tensor lives.
#[derive(Clone, Debug)]
struct Entry {
    dtype: Dtype,
    shape: Vec<usize>,
    file: usize,
    start: usize,
    end: usize,
}

/// A checkpoint directory's tensors, memory mapped (or, for synthetic checkpoints, held in
/// memory).
pub struct Checkpoint {
    files: Vec<(PathBuf, Backing)>,
    tensors: BTreeMap<String, Entry>,
}

/// The bytes of one file.
enum Backing {
    Map(Mmap),
    Memory(Vec<u8>),
}

impl std::ops::Deref for Backing {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Backing::Map(m) => m,
            Backing::Memory(v) => v,
        }
    }
}

/// One tensor's bytes (little endian, row-major) and description.
#[derive(Clone, Copy, Debug)]
pub struct Tensor<'a> {
    pub name: &'a str,
    pub path: &'a Path,
    pub dtype: Dtype,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

#[derive(Deserialize)]
struct Index {
    weight_map: BTreeMap<String, String>,
}

/// The first little-endian `W`-byte element of `bytes` with every bit of `mask` set, and its
/// bits: blocks folded without an early exit (vectorized: about 15 GB/s here, a third of that
/// with one), then the block that has one searched.
fn first_with_bits<const W: usize>(bytes: &[u8], mask: u32) -> Option<(usize, u32)> {
    let value = |c: &[u8]| {
        let mut a = [0u8; 4];
        a[..W].copy_from_slice(&c[..W]);
        u32::from_le_bytes(a)
    };
    let hit = |c: &[u8]| value(c) & mask == mask;
    const BLOCK: usize = 8192;
    let (k, block) = bytes.chunks(BLOCK).enumerate().find(|(_, b)| b.chunks_exact(W).fold(false, |a, c| a | hit(c)))?;
    let i = block.chunks_exact(W).position(hit)?;
    Some((k * BLOCK / W + i, value(&block[i * W..])))
}

fn err(path: &Path, tensor: &str, reason: impl Into<String>) -> Error {
    Error::Checkpoint { path: path.to_path_buf(), tensor: tensor.to_string(), reason: reason.into() }
}

impl Checkpoint {
    /// Opens `dir/model.safetensors`, or every shard `dir/model.safetensors.index.json` names.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let mut ck = Checkpoint { files: Vec::new(), tensors: BTreeMap::new() };
        if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| err(&index, "", format!("cannot be read: {e}")))?;
            let idx: Index =
                serde_json::from_str(&text).map_err(|e| err(&index, "", format!("is not a valid index: {e}")))?;
            let mut shards: Vec<&String> = idx.weight_map.values().collect();
            shards.sort();
            shards.dedup();
            for shard in shards {
                if shard.contains('/') || shard.contains('\\') || shard.starts_with("..") {
                    return Err(err(&index, "", format!("names a shard outside the checkpoint: {shard}")));
                }
                ck.add_file(&dir.join(shard))?;
            }
            for (name, shard) in &idx.weight_map {
                let entry = ck
                    .tensors
                    .get(name)
                    .ok_or_else(|| err(&dir.join(shard), name, "is listed in the index but not in the shard"))?;
                if ck.files[entry.file].0 != dir.join(shard) {
                    return Err(err(
                        &dir.join(shard),
                        name,
                        "is listed in the index for another shard than the one that holds it",
                    ));
                }
            }
        } else if single.exists() {
            ck.add_file(&single)?;
        } else {
            return Err(err(dir, "", "holds neither model.safetensors nor model.safetensors.index.json"));
        }
        Ok(ck)
    }

    /// Maps one safetensors file and records its tensors.
    fn add_file(&mut self, path: &Path) -> Result<()> {
        // Only regular files: opening a FIFO would block, a device file map whatever it holds.
        let meta = std::fs::metadata(path).map_err(|e| err(path, "", format!("cannot be opened: {e}")))?;
        if !meta.is_file() {
            return Err(err(path, "", "is not a regular file"));
        }
        let file = File::open(path).map_err(|e| err(path, "", format!("cannot be opened: {e}")))?;
        // SAFETY: the mapping is read-only; the checkpoint's files must not be modified while
        // a Checkpoint is alive (documented on `open`'s caller side: weights are read at load).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| err(path, "", format!("cannot be mapped: {e}")))?;
        let (n, meta) = SafeTensors::read_metadata(&map)
            .map_err(|e| err(path, "", format!("is not a valid safetensors file: {e}")))?;
        let base = 8 + n;
        let index = self.files.len();
        for (name, info) in meta.tensors() {
            let dtype = match info.dtype {
                safetensors::Dtype::BF16 => Dtype::Bf16,
                safetensors::Dtype::F16 => Dtype::F16,
                safetensors::Dtype::F32 => Dtype::F32,
                safetensors::Dtype::F8_E4M3 => Dtype::F8E4M3,
                safetensors::Dtype::U8 => Dtype::U8,
                other => {
                    return Err(err(
                        path,
                        &name,
                        format!("has dtype {other:?}; supported: BF16, F16, F32, F8_E4M3, U8 (NVFP4)"),
                    ));
                }
            };
            if self.tensors.contains_key(&name) {
                return Err(err(path, &name, "appears in more than one file"));
            }
            let (start, end) = (base + info.data_offsets.0, base + info.data_offsets.1);
            self.tensors.insert(name, Entry { dtype, shape: info.shape.clone(), file: index, start, end });
        }
        self.files.push((path.to_path_buf(), Backing::Map(map)));
        Ok(())
    }

    /// A checkpoint held in memory: `buffers` and, per tensor, its name, dtype, shape and the
    /// buffer whose first bytes it is (tensors may share a buffer). For synthetic checkpoints.
    pub(crate) fn in_memory(
        buffers: Vec<Vec<u8>>,
        tensors: Vec<(String, Dtype, Vec<usize>, usize)>,
    ) -> Result<Checkpoint> {
        let mut ck = Checkpoint { files: Vec::new(), tensors: BTreeMap::new() };
        for (name, dtype, shape, file) in tensors {
            let end = shape.iter().product::<usize>() * dtype.size();
            if buffers.get(file).is_none_or(|b| b.len() < end) {
                return Err(err(Path::new("memory"), &name, "lies outside its buffer"));
            }
            ck.tensors.insert(name, Entry { dtype, shape, file, start: 0, end });
        }
        ck.files = buffers.into_iter().map(|b| (PathBuf::from("memory"), Backing::Memory(b))).collect();
        Ok(ck)
    }

    /// Names of all tensors, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Total bytes of tensor data (for progress reporting).
    pub fn total_bytes(&self) -> usize {
        self.tensors.values().map(|e| e.end - e.start).sum()
    }

    /// Whether a tensor exists.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The tensor `name`, whatever its shape.
    pub fn tensor(&self, name: &str) -> Result<Tensor<'_>> {
        let (key, e) = self.tensors.get_key_value(name).ok_or_else(|| {
            let path = self.files.first().map_or(Path::new(""), |f| f.0.as_path());
            err(path.parent().unwrap_or(path), name, "is missing from the checkpoint")
        })?;
        let (path, map) = &self.files[e.file];
        Ok(Tensor { name: key, path, dtype: e.dtype, shape: &e.shape, bytes: &map[e.start..e.end] })
    }

    /// The tensor `name`, which must have exactly `shape`.
    pub fn expect(&self, name: &str, shape: &[usize]) -> Result<Tensor<'_>> {
        let t = self.tensor(name)?;
        if t.shape != shape {
            return Err(err(t.path, name, format!("has shape {:?}, expected {shape:?}", t.shape)));
        }
        Ok(t)
    }
}

impl Tensor<'_> {
    /// Elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values as f32 (exact from bf16, f16, f32). FP8 weights need their scale: an error.
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let b = self.bytes;
        Ok(match self.dtype {
            Dtype::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            Dtype::Bf16 => b.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            Dtype::F16 => b.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            Dtype::F8E4M3 => {
                return Err(err(self.path, self.name, "is FP8; read it with its weight_scale, not as floats"));
            }
            Dtype::U8 => {
                return Err(err(self.path, self.name, "is packed NVFP4; read it with its scales, not as floats"));
            }
        })
    }

    /// The first element that is NaN or infinite (an e4m3 NaN code for FP8), with its bits,
    /// if any.
    pub fn first_non_finite(&self) -> Option<(usize, u32)> {
        // Every exponent bit set (e4m3: exponent and mantissa).
        let b = self.bytes;
        match self.dtype {
            Dtype::Bf16 => first_with_bits::<2>(b, 0x7F80),
            Dtype::F16 => first_with_bits::<2>(b, 0x7C00),
            Dtype::F32 => first_with_bits::<4>(b, 0x7F80_0000),
            Dtype::F8E4M3 => first_with_bits::<1>(b, 0x7F),
            // Every byte is two finite e2m1 codes.
            Dtype::U8 => None,
        }
    }

    /// The values as bf16 (bf16 as stored; f16 and f32 rounded to nearest even).
    pub fn to_bf16(&self) -> Result<Vec<bf16>> {
        match self.dtype {
            Dtype::Bf16 => Ok(self.bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]])).collect()),
            _ => Ok(self.to_f32()?.into_iter().map(bf16::from_f32).collect()),
        }
    }

    /// A single value (shape `[]` or `[1]`), such as an FP8 `weight_scale` or `input_scale`.
    pub fn scalar(&self) -> Result<f32> {
        match (self.len(), self.to_f32()?.first()) {
            (1, Some(&v)) => Ok(v),
            _ => Err(err(self.path, self.name, format!("has shape {:?}, expected a single value", self.shape))),
        }
    }
}
