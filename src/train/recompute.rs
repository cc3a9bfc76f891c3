//! Activation recomputation for a training step (`recompute_activations`): the decoder stack
//! runs forward once without a graph, keeping only each layer's input; the backward pass then
//! goes down the stack one layer at a time, re-running that layer with a graph from its saved
//! input and sending the gradient of the layer above back through it.
//!
//! The rule it relies on is the chain rule cut at layer boundaries: with `h_{i+1} = f_i(h_i)` and
//! `g_{i+1} = ∂L/∂h_{i+1}` held constant, the gradient of `⟨f_i(h_i), g_{i+1}⟩` is `∂L/∂θ_i` for
//! the layer's parameters and `g_i = ∂L/∂h_i` for its input. So the gradients are those of the
//! whole graph, summed in another order.
//!
//! Memory: a step holds every layer's input (`layers × tokens × hidden` floats) and the
//! activations of one layer of one packed group at a time, instead of every layer's activations
//! of the whole batch: an adapter's step on one 12k-token sample of Qwen3-0.6B's shape peaks under
//! 6 GiB, where the stored graph would need tens of GiB. The cost is one more forward pass of
//! the stack.

use burn::module::{AutodiffModule, Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor};

use super::batch::BatchLayout;
use super::learner::{flatten, group_ids, window_head};
use super::packing::Packing;
use crate::model::qwen3::DecoderLayer;
use crate::model::Qwen3;

/// What one packed group holds between two layers: its shared prefix `[1, p, hidden]` (when
/// it has one) and its rows `[r, l, hidden]`.
struct Stage<B: Backend> {
    prefix: Option<Tensor<B, 3>>,
    rows: Tensor<B, 3>,
}

impl<B: Backend> Clone for Stage<B> {
    fn clone(&self) -> Self {
        Stage {
            prefix: self.prefix.clone(),
            rows: self.rows.clone(),
        }
    }
}

/// `(cos, sin)` of a group's prefix positions (when it has a prefix) and of its rows'.
type Ropes<B> = (
    Option<(Tensor<B, 4>, Tensor<B, 4>)>,
    (Tensor<B, 4>, Tensor<B, 4>),
);

/// One packed group's token ids and saved layer inputs.
struct Group<B: AutodiffBackend> {
    prefix_ids: Option<Tensor<B, 2, Int>>,
    rows_ids: Tensor<B, 2, Int>,
    /// `inputs[i]`: the input of layer `i`, without a graph.
    inputs: Vec<Stage<B::InnerBackend>>,
    /// The stack's output as leaves the head's graph starts from.
    top: Stage<B>,
}

/// The decoder stack of one step, run forward without its graph ([`Trunk::forward`]) and
/// back-propagated layer by layer ([`Trunk::backward`]).
pub(crate) struct Trunk<B: AutodiffBackend> {
    groups: Vec<Group<B>>,
}

impl<B: AutodiffBackend> Trunk<B> {
    /// Runs `model`'s stack over `packing`'s groups without a graph, keeping each layer's
    /// input, and the head with one over the stack's output → the trunk and the logits
    /// `[batch, window, vocab]` ([`super::learner::window_logits`]'s, the same values).
    pub(crate) fn forward(
        model: &Qwen3<B>,
        layout: &BatchLayout,
        packing: &Packing,
    ) -> (Trunk<B>, Tensor<B, 3>) {
        let inner = model.valid();
        let device = model.device();
        let mut groups = Vec::with_capacity(packing.groups.len());
        let mut states = Vec::with_capacity(2 * packing.groups.len());
        for g in &packing.groups {
            let (prefix_ids, rows_ids) = group_ids::<B>(g, &device);
            let ropes = ropes(&inner, g.prefix.len(), g.len);
            let mut x = Stage {
                prefix: prefix_ids.clone().map(|ids| inner.embed(ids.inner())),
                rows: inner.embed(rows_ids.clone().inner()),
            };
            let mut inputs = Vec::with_capacity(inner.layers.len());
            for layer in &inner.layers {
                inputs.push(x.clone());
                x = through(layer, x, &ropes);
            }
            let top = Stage {
                prefix: x.prefix.map(|t| Tensor::from_inner(t).require_grad()),
                rows: Tensor::from_inner(x.rows).require_grad(),
            };
            if let Some(p) = &top.prefix {
                states.push(flatten(p.clone()));
            }
            states.push(flatten(top.rows.clone()));
            groups.push(Group {
                prefix_ids,
                rows_ids,
                inputs,
                top,
            });
        }
        let logits = window_head(model, layout, packing, states);
        (Trunk { groups }, logits)
    }

    /// The gradients of every parameter of `model` from `grads`, those of the loss over the
    /// logits [`Trunk::forward`] gave: the head's from `grads`, each layer's and the
    /// embedding's by re-running the stack one layer at a time from the top.
    pub(crate) fn backward(self, model: &Qwen3<B>, mut grads: B::Gradients) -> GradientsParams {
        let mut acc = GradientsParams::new();
        let mut tops = Vec::with_capacity(self.groups.len());
        for g in &self.groups {
            tops.push(Stage {
                prefix: g.top.prefix.as_ref().map(|p| grad_or_zeros(p, &grads)),
                rows: grad_or_zeros(&g.top.rows, &grads),
            });
        }
        model.visit(&mut Accumulate::<B> {
            grads: &mut grads,
            acc: &mut acc,
        });
        drop(grads);

        let embed_trained = model.embed_tokens.val().is_require_grad();
        for (group, mut g) in self.groups.into_iter().zip(tops) {
            let (p, l) = group.lengths();
            let ropes = ropes(model, p, l);
            let mut inputs = group.inputs;
            for layer in model.layers.iter().rev() {
                let saved = inputs.pop().expect("one input per layer");
                let x = Stage {
                    prefix: saved.prefix.map(|t| Tensor::from_inner(t).require_grad()),
                    rows: Tensor::from_inner(saved.rows).require_grad(),
                };
                let out = through(layer, x.clone(), &ropes);
                let mut layer_grads = weighted_sum(out, g).backward();
                layer.visit(&mut Accumulate::<B> {
                    grads: &mut layer_grads,
                    acc: &mut acc,
                });
                g = Stage {
                    prefix: x.prefix.as_ref().map(|p| grad_or_zeros(p, &layer_grads)),
                    rows: grad_or_zeros(&x.rows, &layer_grads),
                };
            }
            if embed_trained {
                let embedded = Stage {
                    prefix: group.prefix_ids.map(|ids| model.embed(ids)),
                    rows: model.embed(group.rows_ids),
                };
                let mut embed_grads = weighted_sum(embedded, g).backward();
                if let Some(e) = model.embed_tokens.val().grad_remove(&mut embed_grads) {
                    add(&mut acc, model.embed_tokens.id, e);
                }
            }
        }
        acc
    }
}

impl<B: AutodiffBackend> Group<B> {
    /// The lengths of its prefix (0 without one) and of its rows.
    fn lengths(&self) -> (usize, usize) {
        let p = self.prefix_ids.as_ref().map_or(0, |t| t.dims()[1]);
        (p, self.rows_ids.dims()[1])
    }
}

/// The rotary tables of a group whose prefix has `p` tokens (none when 0) and whose rows `l`:
/// the prefix at positions `0..p`, the rows after it.
fn ropes<B: Backend>(model: &Qwen3<B>, p: usize, l: usize) -> Ropes<B> {
    if p > 0 {
        (Some(model.rope(0, p)), model.rope(p, l))
    } else {
        (None, model.rope(0, l))
    }
}

/// One decoder layer over a group: the prefix and its rows together, or the rows alone.
fn through<B: Backend>(layer: &DecoderLayer<B>, x: Stage<B>, ropes: &Ropes<B>) -> Stage<B> {
    match (x.prefix, &ropes.0) {
        (Some(p), Some(rope_prefix)) => {
            let (p, r) = layer.forward_prefixed(p, x.rows, rope_prefix.clone(), ropes.1.clone());
            Stage {
                prefix: Some(p),
                rows: r,
            }
        }
        (None, None) => Stage {
            prefix: None,
            rows: layer.forward(x.rows, ropes.1 .0.clone(), ropes.1 .1.clone()),
        },
        _ => unreachable!("a group's stages and rotary tables agree on its prefix"),
    }
}

/// `⟨out, g⟩` summed over a group's prefix and rows: its gradient sends `g` back through the
/// graph of `out`.
fn weighted_sum<B: AutodiffBackend>(out: Stage<B>, g: Stage<B::InnerBackend>) -> Tensor<B, 1> {
    let rows = (out.rows * Tensor::from_inner(g.rows)).sum();
    match (out.prefix, g.prefix) {
        (Some(p), Some(gp)) => rows + (p * Tensor::from_inner(gp)).sum(),
        _ => rows,
    }
}

/// The gradient `grads` holds for the leaf `x`, or zeros where nothing downstream used it (a
/// prefix whose positions are outside every response window still feeds its rows' attention).
fn grad_or_zeros<B: AutodiffBackend>(
    x: &Tensor<B, 3>,
    grads: &B::Gradients,
) -> Tensor<B::InnerBackend, 3> {
    x.grad(grads)
        .unwrap_or_else(|| Tensor::zeros(x.dims(), &x.device()))
}

/// Moves each parameter's gradient out of `grads` and adds it to what `acc` holds for it.
struct Accumulate<'a, B: AutodiffBackend> {
    grads: &'a mut B::Gradients,
    acc: &'a mut GradientsParams,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Accumulate<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = param.val().grad_remove(self.grads) {
            add(self.acc, param.id, g);
        }
    }
}

fn add<B: Backend, const D: usize>(
    acc: &mut GradientsParams,
    id: burn::module::ParamId,
    g: Tensor<B, D>,
) {
    let sum = match acc.remove::<B, D>(id) {
        Some(prev) => prev + g,
        None => g,
    };
    acc.register::<B, D>(id, sum);
}
