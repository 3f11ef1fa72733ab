//! Per-unit backward (see "Backward by recompute" and "Keep or recompute"
//! in the module docs): by recompute from the saved input
//! ([`Model::backward_unit`]), or from a forward recorded with its graph
//! ([`Model::record_unit`], [`Model::backward_recorded`]).

use candle_core::{Tensor, Var};

use super::{fused, Model, ModelError, UnitGrads, UnitId, UnitInput, UnitOutput, Upstream};

/// A unit's forward with its graph, kept for its backward
/// ([`Model::record_unit`]).
#[derive(Debug)]
pub struct RecordedUnit {
    unit: UnitId,
    vars: Vec<Var>,
    input: Option<Var>,
    out: UnitOutput,
    /// Bytes the graph's fused ops keep inside themselves
    /// ([`fused::count_hidden`]).
    hidden_bytes: u64,
}

impl RecordedUnit {
    /// The unit's hidden output, detached from the graph (the next unit's
    /// input: its own graph must not reach into this one); `None` for the
    /// head.
    pub fn hidden(&self) -> Option<Tensor> {
        match &self.out {
            UnitOutput::Hidden(y) => Some(y.detach()),
            UnitOutput::Loss(_) => None,
        }
    }

    /// Bytes the record holds: the distinct storages of every tensor on a
    /// path from the output to a param or the input (the params' and the
    /// input's `Var` copies included), each counted once however many views
    /// share it, as far as its views reach. Constants off those paths (the
    /// causal mask, rotary tables) are not counted; they are small and
    /// shared. Plus what the fused ops keep inside themselves for their
    /// backward (a fused linear + GELU's pre-activation), which no graph
    /// walk sees.
    pub fn held_bytes(&self) -> u64 {
        let mut spans: std::collections::HashMap<usize, u64> = std::collections::HashMap::new();
        for t in self.out.tensor().sorted_nodes() {
            let (storage, layout) = t.storage_and_layout();
            let key = std::ptr::from_ref::<candle_core::Storage>(&storage).addr();
            let reach = if layout.shape().elem_count() == 0 {
                0
            } else {
                layout.start_offset()
                    + layout
                        .dims()
                        .iter()
                        .zip(layout.stride())
                        .map(|(&d, &s)| (d - 1) * s)
                        .sum::<usize>()
                    + 1
            };
            let bytes = (reach * t.dtype().size_in_bytes()) as u64;
            let e = spans.entry(key).or_insert(0);
            *e = (*e).max(bytes);
        }
        spans.values().sum::<u64>() + self.hidden_bytes
    }
}

impl Model {
    /// Backward of one unit by recompute (see the module docs). `input` is
    /// the same input the forward got; `upstream` is `Grad(dL/d output)` for
    /// the embedding and blocks and `LossScale(s)` for the head.
    pub fn backward_unit(
        &self,
        unit: UnitId,
        params: &[Tensor],
        input: UnitInput<'_>,
        upstream: Upstream<'_>,
    ) -> Result<UnitGrads, ModelError> {
        let recorded = self.record_unit(unit, params, input)?;
        self.backward_recorded(recorded, upstream)
    }

    /// One unit's forward with its graph kept for backward (the activation
    /// policy's *keep*, see "Keep or recompute" in the module docs): the
    /// params and the hidden input become candle `Var`s (one copy each),
    /// and the output holds every intermediate its backward needs.
    /// [`Model::backward_recorded`] then backpropagates without running the
    /// forward again. [`Model::backward_unit`] is this followed by that, so
    /// keeping a unit and recomputing it give the same bits.
    pub fn record_unit(
        &self,
        unit: UnitId,
        params: &[Tensor],
        input: UnitInput<'_>,
    ) -> Result<RecordedUnit, ModelError> {
        let spec = self.unit(unit)?;
        // Validate before copying anything.
        self.check_params(spec, params)?;
        let vars = params
            .iter()
            .map(Var::from_tensor)
            .collect::<candle_core::Result<Vec<_>>>()?;
        let var_tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let bad = |reason: &str| ModelError::BadInput {
            unit,
            reason: reason.to_string(),
        };
        // The input as a Var when it is a hidden state (needs a gradient).
        let (input_var, targets) = match input {
            UnitInput::Tokens(_) => (None, None),
            UnitInput::Hidden(x) => (Some(Var::from_tensor(x)?), None),
            UnitInput::HiddenWithTargets { hidden, targets } => {
                (Some(Var::from_tensor(hidden)?), Some(targets))
            }
        };
        let recompute_input = match (&input_var, input, targets) {
            (None, UnitInput::Tokens(ids), _) => UnitInput::Tokens(ids),
            (Some(x), _, None) => UnitInput::Hidden(x.as_tensor()),
            (Some(x), _, Some(targets)) => UnitInput::HiddenWithTargets {
                hidden: x.as_tensor(),
                targets,
            },
            _ => return Err(bad("inconsistent input")),
        };
        let (out, hidden_bytes) =
            fused::count_hidden(|| self.run_unit(spec, &var_tensors, recompute_input));
        Ok(RecordedUnit {
            unit,
            vars,
            input: input_var,
            out: out?,
            hidden_bytes,
        })
    }

    /// Backward of a unit recorded by [`Model::record_unit`] (see
    /// [`Model::backward_unit`] for `upstream`). Consumes the record: its
    /// graph is freed when this returns.
    pub fn backward_recorded(
        &self,
        recorded: RecordedUnit,
        upstream: Upstream<'_>,
    ) -> Result<UnitGrads, ModelError> {
        let RecordedUnit {
            unit,
            vars,
            input: input_var,
            out,
            hidden_bytes: _,
        } = recorded;
        let spec = self.unit(unit)?;
        let bad = |reason: &str| ModelError::BadInput {
            unit,
            reason: reason.to_string(),
        };
        let (objective, loss) = match (out, upstream) {
            (UnitOutput::Loss(loss), Upstream::LossScale(s)) => {
                (loss.affine(s, 0.0)?, Some(loss.detach()))
            }
            (UnitOutput::Hidden(y), Upstream::Grad(g)) => {
                if g.dims() != y.dims() || g.dtype() != y.dtype() {
                    return Err(ModelError::BadInput {
                        unit,
                        reason: format!(
                            "upstream grad {:?} {:?} does not match output {:?} {:?}",
                            g.dims(),
                            g.dtype(),
                            y.dims(),
                            y.dtype()
                        ),
                    });
                }
                // d/dy <y, g> = g exactly; g is constant (not a Var).
                (fused::upstream_objective(&y, g)?, None)
            }
            (UnitOutput::Loss(_), Upstream::Grad(_)) => {
                return Err(bad("the head starts from Upstream::LossScale"))
            }
            (UnitOutput::Hidden(_), Upstream::LossScale(_)) => {
                return Err(bad("only the head takes Upstream::LossScale"))
            }
        };
        let grads = objective.backward()?;
        let mut param_grads = Vec::with_capacity(vars.len());
        for (id, var) in spec.params.iter().zip(&vars) {
            let g = grads
                .get(var.as_tensor())
                .ok_or_else(|| ModelError::MissingGradient {
                    name: self.params[id.0].name.clone(),
                })?;
            param_grads.push((*id, g.clone()));
        }
        let input_grad = match &input_var {
            Some(x) => Some(grads.get(x.as_tensor()).cloned().ok_or_else(|| {
                ModelError::MissingGradient {
                    name: format!("input of unit {unit:?}"),
                }
            })?),
            None => None,
        };
        Ok(UnitGrads {
            params: param_grads,
            input: input_grad,
            loss,
        })
    }
}
