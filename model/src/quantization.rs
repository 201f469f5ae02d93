//! The quantization a ModelOpt checkpoint declares, from `hf_quant_config.json` beside its
//! config.json (`{"quantization": {"quant_algo", "kv_cache_quant_algo", "group_size",
//! "exclude_modules" | "quantized_layers"}}`) or from config.json's `quantization_config`
//! (`"quant_method": "modelopt"`, `"quant_algo"`, `"kv_cache_scheme"`, `"exclude_modules"`).
//! Which layers are quantized the tensors themselves say (their dtypes and scales, checked by
//! the layout), and the layout holds them to the declaration ([`Quantization::declared`]): a
//! quantized weight in a module `exclude_modules` names (`*` any run of characters), of another
//! format than `quant_algo`, or, for `MIXED_PRECISION`, not of the format its entry in
//! `quantized_layers` gives (or without an entry, or an entry's module left bf16), is an error
//! naming the tensor. An algorithm or block size this crate does not run is an error, and an FP8
//! KV cache is reported (`kv_cache`), since the engine keeps its cache in bf16 and does not use
//! the checkpoint's `k_scale` / `v_scale`.

use serde_json::Value;

use crate::error::{Error, Result};

/// A checkpoint's declared quantization.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Quantization {
    /// `FP8`, `NVFP4` or `MIXED_PRECISION` (layers of both).
    pub quant_algo: String,
    /// The KV cache's declared format (`FP8`), if any: the engine keeps a bf16 cache.
    pub kv_cache: Option<String>,
    /// `exclude_modules`: patterns of the modules left unquantized.
    pub exclude: Vec<String>,
    /// `quantized_layers` (`MIXED_PRECISION`): each module's algorithm.
    pub layers: Vec<(String, String)>,
    /// Where it was read.
    pub source: &'static str,
}

/// What a declaration says of one module's weight.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Declared<'q> {
    /// Quantized with this algorithm (`FP8`, `NVFP4`).
    As(&'q str),
    /// Left unquantized by this pattern of `exclude_modules`.
    Excluded(&'q str),
    /// `MIXED_PRECISION` without an entry for it in `quantized_layers`: unquantized.
    Unlisted,
}

/// Algorithms whose layers this crate runs (by the tensors' dtypes).
const ALGOS: [&str; 3] = ["FP8", "NVFP4", "MIXED_PRECISION"];

/// Where a declaration is read: its errors name the file and the field.
const HF_QUANT_CONFIG: &str = "hf_quant_config.json";
const QUANTIZATION_CONFIG: &str = "config.json quantization_config";

fn bad(source: &str, field: &str, reason: impl Into<String>) -> Error {
    let reason = reason.into();
    if source == HF_QUANT_CONFIG {
        Error::Checkpoint { path: HF_QUANT_CONFIG.into(), tensor: String::new(), reason: format!("`{field}` {reason}") }
    } else {
        Error::Config { field: format!("quantization_config.{field}"), reason }
    }
}

impl Quantization {
    /// `hf_quant_config.json`'s text.
    pub fn from_hf_quant_config(text: &str) -> Result<Quantization> {
        let source = HF_QUANT_CONFIG;
        let v: Value = serde_json::from_str(text).map_err(|e| bad(source, "(the file)", e.to_string()))?;
        let q = v.get("quantization").ok_or_else(|| bad(source, "quantization", "is missing"))?;
        let kv = q.get("kv_cache_quant_algo").filter(|k| !k.is_null());
        let kv = kv.map(|k| {
            k.as_str().map(str::to_string).ok_or_else(|| bad(source, "kv_cache_quant_algo", "is not a string"))
        });
        Quantization::checked(source, q, kv.transpose()?)
    }

    /// config.json's `quantization_config` (`v`).
    pub fn from_quantization_config(v: &Value) -> Result<Quantization> {
        let source = QUANTIZATION_CONFIG;
        match v.get("quant_method").and_then(Value::as_str) {
            Some("modelopt") => {}
            other => {
                let why = format!("{other:?} is not supported (ModelOpt checkpoints, \"modelopt\", load)");
                return Err(bad(source, "quant_method", why));
            }
        }
        let kv = match v.get("kv_cache_scheme").filter(|k| !k.is_null()) {
            None => None,
            Some(k)
                if k.get("type").and_then(Value::as_str) == Some("float") && k.get("num_bits") == Some(&8.into()) =>
            {
                Some("FP8".to_string())
            }
            Some(k) => return Err(bad(source, "kv_cache_scheme", format!("{k} is not supported (8-bit float)"))),
        };
        Quantization::checked(source, v, kv)
    }

    /// The algorithm and group size of `q` checked; `kv` the KV cache's format.
    fn checked(source: &'static str, q: &Value, kv: Option<String>) -> Result<Quantization> {
        let algo =
            q.get("quant_algo").and_then(Value::as_str).ok_or_else(|| bad(source, "quant_algo", "is missing"))?;
        if !ALGOS.contains(&algo) {
            return Err(bad(source, "quant_algo", format!("\"{algo}\" is not supported ({})", ALGOS.join(", "))));
        }
        if let Some(g) = q.get("group_size").filter(|g| !g.is_null())
            && algo == "NVFP4"
            && g.as_u64() != Some(16)
        {
            return Err(bad(source, "group_size", format!("{g} is not supported (NVFP4 blocks of 16)")));
        }
        if let Some(k) = kv.as_deref().filter(|k| *k != "FP8") {
            return Err(bad(source, "kv_cache_quant_algo", format!("\"{k}\" is not supported (FP8, or none)")));
        }
        let strings = |field: &str| -> Result<Vec<String>> {
            match q.get(field).filter(|v| !v.is_null()) {
                None => Ok(Vec::new()),
                Some(Value::Array(a)) => a
                    .iter()
                    .map(|v| v.as_str().map(str::to_string).ok_or_else(|| bad(source, field, format!("holds {v}"))))
                    .collect(),
                Some(v) => Err(bad(source, field, format!("is {v}, not a list of names"))),
            }
        };
        let exclude = strings("exclude_modules")?;
        let layers = match q.get("quantized_layers").filter(|v| !v.is_null()) {
            None => Vec::new(),
            Some(Value::Object(m)) => m
                .iter()
                .map(|(name, v)| match v.get("quant_algo").and_then(Value::as_str) {
                    Some(a @ ("FP8" | "NVFP4")) => Ok((name.clone(), a.to_string())),
                    _ => Err(bad(source, "quantized_layers", format!("`{name}`: {v} is not FP8 or NVFP4"))),
                })
                .collect::<Result<_>>()?,
            Some(v) => Err(bad(source, "quantized_layers", format!("is {v}, not an object")))?,
        };
        Ok(Quantization { quant_algo: algo.to_string(), kv_cache: kv, exclude, layers, source })
    }

    /// What the declaration says of module `module` (a linear layer's name, its weight's
    /// without `.weight`).
    pub fn declared(&self, module: &str) -> Declared<'_> {
        if let Some(p) = self.exclude.iter().find(|p| matches(p, module)) {
            return Declared::Excluded(p);
        }
        if self.quant_algo != "MIXED_PRECISION" {
            return Declared::As(&self.quant_algo);
        }
        match self.layers.iter().find(|(name, _)| name == module) {
            Some((_, algo)) => Declared::As(algo),
            None => Declared::Unlisted,
        }
    }
}

/// Whether `name` matches `pattern`, whose `*` stands for any run of characters.
fn matches(pattern: &str, name: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == name,
        Some((head, rest)) => {
            name.strip_prefix(head).is_some_and(|tail| (0..=tail.len()).any(|i| matches(rest, &tail[i..])))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Declared, Quantization, matches};

    fn err(r: crate::Result<Quantization>) -> String {
        r.err().map(|e| e.to_string()).unwrap_or_default()
    }

    #[test]
    fn both_forms_are_read_and_checked() {
        let nano = r#"{"producer": {"name": "modelopt", "version": "0.29.0"}, "quantization": {"quant_algo": "NVFP4",
            "kv_cache_quant_algo": "FP8", "group_size": 16, "exclude_modules": ["lm_head"]}}"#;
        let q = Quantization::from_hf_quant_config(nano).unwrap();
        assert_eq!((q.quant_algo.as_str(), q.kv_cache.as_deref()), ("NVFP4", Some("FP8")));
        let fp8 = r#"{"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": null}}"#;
        assert_eq!(Quantization::from_hf_quant_config(fp8).unwrap().kv_cache, None);
        let cfg = serde_json::json!({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
            "kv_cache_scheme": {"dynamic": false, "num_bits": 8, "type": "float"}});
        let q = Quantization::from_quantization_config(&cfg).unwrap();
        assert_eq!((q.quant_algo.as_str(), q.kv_cache.as_deref()), ("MIXED_PRECISION", Some("FP8")));

        let e = err(Quantization::from_hf_quant_config(r#"{"quantization": {"quant_algo": "W4A8_AWQ"}}"#));
        assert!(e.contains("hf_quant_config.json: `quant_algo`") && e.contains("W4A8_AWQ"), "{e}");
        let e =
            err(Quantization::from_hf_quant_config(r#"{"quantization": {"quant_algo": "NVFP4", "group_size": 32}}"#));
        assert!(e.contains("group_size") && e.contains("32"), "{e}");
        let e = err(Quantization::from_hf_quant_config(
            r#"{"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "NVFP4"}}"#,
        ));
        assert!(e.contains("kv_cache_quant_algo"), "{e}");
        assert!(err(Quantization::from_hf_quant_config(r#"{"producer": {}}"#)).contains("quantization` is missing"));
        assert!(err(Quantization::from_hf_quant_config("{")).contains("hf_quant_config.json"));
        let e = err(Quantization::from_quantization_config(&serde_json::json!({"quant_method": "fp8"})));
        assert!(e.contains("`quantization_config.quant_method`") && e.contains("fp8"), "{e}");
        let bad_kv =
            serde_json::json!({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_scheme": {"num_bits": 4}});
        assert!(err(Quantization::from_quantization_config(&bad_kv)).contains("kv_cache_scheme"));
        let e = err(Quantization::from_hf_quant_config(
            r#"{"quantization": {"quant_algo": "FP8", "exclude_modules": "x"}}"#,
        ));
        assert!(e.contains("exclude_modules") && e.contains("not a list"), "{e}");
        let e = err(Quantization::from_hf_quant_config(
            r#"{"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": {"a": {"quant_algo": "INT4"}}}}"#,
        ));
        assert!(e.contains("quantized_layers") && e.contains("`a`"), "{e}");
    }

    #[test]
    fn modules_are_declared_by_pattern_and_by_entry() {
        for (p, name, want) in [
            ("lm_head", "lm_head", true),
            ("lm_head", "lm_head2", false),
            ("backbone.layers.4.mixer*", "backbone.layers.4.mixer.in_proj", true),
            ("backbone.layers.4.mixer*", "backbone.layers.44.mixer.in_proj", false),
            ("*.conv1d", "backbone.layers.0.mixer.conv1d", true),
            ("*mixer.*_proj", "backbone.layers.5.mixer.q_proj", true),
            ("*mixer.*_proj", "backbone.layers.5.mixer.gate", false),
            ("*", "anything", true),
            ("a*b*c", "axxbyc", true),
            ("a*b*c", "axxbyd", false),
        ] {
            assert_eq!(matches(p, name), want, "{p} ~ {name}");
        }
        let nano =
            r#"{"quantization": {"quant_algo": "NVFP4", "exclude_modules": ["lm_head", "backbone.layers.4.mixer*"]}}"#;
        let q = Quantization::from_hf_quant_config(nano).unwrap();
        assert_eq!(q.declared("lm_head"), Declared::Excluded("lm_head"));
        assert_eq!(q.declared("backbone.layers.4.mixer.q_proj"), Declared::Excluded("backbone.layers.4.mixer*"));
        assert_eq!(q.declared("backbone.layers.1.mixer.experts.0.up_proj"), Declared::As("NVFP4"));
        let mixed = r#"{"quantization": {"quant_algo": "MIXED_PRECISION",
            "quantized_layers": {"backbone.layers.0.mixer.in_proj": {"quant_algo": "FP8"}}}}"#;
        let q = Quantization::from_hf_quant_config(mixed).unwrap();
        assert_eq!(q.declared("backbone.layers.0.mixer.in_proj"), Declared::As("FP8"));
        assert_eq!(q.declared("backbone.layers.0.mixer.out_proj"), Declared::Unlisted);
    }
}
