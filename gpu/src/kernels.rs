//! The kernel modules: CUDA C sources (`src/kernels/*.cu`, each compiled
//! after `prelude.cu`) and the `extern "C"` entry points each exports.
//!
//! Most kernels are templates over the storage dtype with one entry point
//! per dtype: `NAME_f32`, `NAME_bf16`, `NAME_f16` (compute is fp32
//! whatever the storage). Launch contract: blocks of [`BLOCK_THREADS`]
//! threads; row kernels (norms, softmax, cross-entropy) take one block
//! per row; `sumsq_parts` 8 threads per part (the order is the part's and
//! its lanes', see [`crate::norm`]); column sums over rows (the bias and
//! norm weight gradients) take one thread per column and chunk of
//! [`ROW_CHUNK`] rows, then `col_sums_finish` adds the chunks in order;
//! the others a grid-stride loop.

/// Threads per block of every launch (the reductions' order depends on it).
pub const BLOCK_THREADS: u32 = 256;

/// Rows per chunk of a column sum (`bias_grad`, `layernorm_bwd_wb`,
/// `rmsnorm_bwd_w`): each chunk's rows are added in order by one thread
/// per column, then the chunks' sums in chunk order. A constant, so the
/// order of every sum depends on the shape alone (the same bits on any
/// GPU, and in the references). 128 rows: a step of 8 × 1024 tokens at
/// width 1024 gives 64 chunks × 4 column tiles = 256 blocks of 128 adds
/// each, where one thread per column adding all 8192 rows gave 4 blocks.
pub const ROW_CHUNK: usize = 128;

/// The storage dtypes of the templated kernels, as entry-point suffixes.
pub const DTYPE_SUFFIXES: [&str; 3] = ["f32", "bf16", "f16"];

/// Every module's source starts with this.
pub const PRELUDE: &str = include_str!("kernels/prelude.cu");

/// One module: one NVRTC program.
#[derive(Debug, Clone, Copy)]
pub struct Module {
    /// Its name (the `.cu` file's stem).
    pub name: &'static str,
    body: &'static str,
    /// Kernels with one entry point per storage dtype.
    templated: &'static [&'static str],
    /// Entry points as named.
    plain: &'static [&'static str],
}

impl Module {
    /// The full source: the prelude, then the module.
    pub fn source(&self) -> String {
        format!("{PRELUDE}\n#line 1 \"{}.cu\"\n{}", self.name, self.body)
    }

    /// Its entry points, in source order per kernel.
    pub fn entries(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .templated
            .iter()
            .flat_map(|k| DTYPE_SUFFIXES.iter().map(move |d| format!("{k}_{d}")))
            .collect();
        out.extend(self.plain.iter().map(|s| s.to_string()));
        out
    }
}

macro_rules! module {
    ($name:literal, [$($t:literal),*], [$($p:literal),*]) => {
        Module {
            name: $name,
            body: include_str!(concat!("kernels/", $name, ".cu")),
            templated: &[$($t),*],
            plain: &[$($p),*],
        }
    };
}

/// Every module.
pub const MODULES: &[Module] = &[
    module!("embedding", ["embedding_fwd", "embedding_bwd"], []),
    module!(
        "norm",
        [
            "layernorm_fwd",
            "layernorm_bwd_dx",
            "layernorm_bwd_wb",
            "rmsnorm_fwd",
            "rmsnorm_bwd_dx",
            "rmsnorm_bwd_w"
        ],
        []
    ),
    module!("rope", ["rope"], []),
    module!("softmax", ["softmax_causal_fwd", "softmax_bwd"], []),
    module!(
        "activation",
        ["gelu_tanh_fwd", "gelu_tanh_bwd", "swiglu_fwd", "swiglu_bwd"],
        []
    ),
    module!("bias", ["bias_add", "bias_grad"], ["col_sums_finish"]),
    module!("cross_entropy", ["cross_entropy"], ["sum_f32"]),
    module!(
        "cast",
        [],
        [
            "cast_f32_bf16",
            "cast_f32_f16",
            "cast_bf16_f32",
            "cast_f16_f32",
            "cast_bf16_f16",
            "cast_f16_bf16"
        ]
    ),
    module!("optim", ["adamw"], ["sumsq_parts"]),
    module!(
        "layout",
        [
            "heads_from_rows",
            "rows_from_heads",
            "add",
            "add_chunks",
            "repeat_kv",
            "sum_kv"
        ],
        []
    ),
];

/// The module named `name`.
pub fn module(name: &str) -> Option<&'static Module> {
    MODULES.iter().find(|m| m.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_listed_entry_is_defined_in_its_source() {
        for m in MODULES {
            let src = m.source();
            for e in m.entries() {
                let defined = if let Some((base, _)) = e
                    .rsplit_once('_')
                    .filter(|_| m.templated.iter().any(|t| e.starts_with(t)))
                {
                    // Templated: a wrapper macro pastes `base ## _ ## SUF`.
                    src.contains(&format!("{base}_##SUF"))
                } else {
                    src.contains(&format!("void {e}(")) || src.contains(&format!("TZ_CAST({e},"))
                };
                assert!(defined, "{}: entry {e} not in the source", m.name);
            }
        }
    }
}
