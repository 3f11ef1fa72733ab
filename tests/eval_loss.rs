//! `tierzero::eval::evaluate` against a cross-entropy computed independently:
//! the same tiny models run unit by unit in **f64**, then an explicit
//! log-softmax per predicted position, window by window (no batching), and
//! the mean over predicted tokens. Also: the training head's loss
//! (`Model::forward_full`) per window, batch-size independence, and every
//! input error.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod model_support;

use candle_core::{DType, Device, Tensor};
use model_support::*;
use tierzero::eval::{evaluate, EvalError, EvalOptions, EvalResult};
use tierzero::model::{Model, ModelConfig, ModelError, UnitInput, UnitKind};

fn opts(seq_len: usize, batch_windows: usize) -> EvalOptions {
    EvalOptions {
        seq_len,
        batch_windows,
        device: Device::Cpu,
        pass_bytes: tierzero::eval::DEFAULT_PASS_BYTES,
        dtype: DType::F32,
    }
}

fn tokens(n: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i * 5 + (i * i) % 7) % vocab) as u32)
        .collect()
}

fn run(model: &Model, params: &[Tensor], toks: &[u32], o: &EvalOptions) -> EvalResult {
    evaluate(
        model,
        |id| Ok::<_, ModelError>(params[id.0].clone()),
        toks,
        o,
    )
    .unwrap()
}

/// Sum of -log p(next token) over one window, everything in f64.
fn window_nll_f64(model: &Model, params_f64: &[Tensor], window: &[u32]) -> f64 {
    let t = window.len() - 1;
    let ids = Tensor::from_vec(window[..t].to_vec(), (1, t), &Device::Cpu).unwrap();
    let mut hidden = None;
    let mut logits = None;
    for unit in model.units() {
        let p = model.unit_params(unit.id, params_f64).unwrap();
        match unit.kind {
            UnitKind::Embedding => {
                hidden = Some(
                    model
                        .forward_unit(unit.id, &p, UnitInput::Tokens(&ids))
                        .unwrap()
                        .into_tensor(),
                )
            }
            UnitKind::Block { .. } => {
                let h = hidden.take().unwrap();
                hidden = Some(
                    model
                        .forward_unit(unit.id, &p, UnitInput::Hidden(&h))
                        .unwrap()
                        .into_tensor(),
                )
            }
            UnitKind::Head => logits = Some(model.logits(&p, hidden.as_ref().unwrap()).unwrap()),
        }
    }
    let logits: Vec<Vec<f64>> = logits
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec2::<f64>()
        .unwrap();
    assert_eq!(logits.len(), t);
    let mut sum = 0.0;
    for (pos, row) in logits.iter().enumerate() {
        // log_softmax(row)[target] = row[target] - log(sum(exp(row))), written out.
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = row.iter().map(|x| (x - m).exp()).sum();
        let target = window[pos + 1] as usize;
        sum += -(row[target] - m - z.ln());
    }
    sum
}

fn check_against_reference(cfg: ModelConfig) {
    let model = Model::new(cfg).unwrap();
    let vocab = model.config().vocab_size;
    let params32 = random_params(&model, 7, DType::F32);
    let params64: Vec<Tensor> = params32
        .iter()
        .map(|t| t.to_dtype(DType::F64).unwrap())
        .collect();
    // 23 tokens, L = 5: 4 full windows and a partial one of 3 tokens:
    // 4 * 4 + 2 = 18 predictions.
    let toks = tokens(23, vocab);
    let l = 5;
    let mut nll = 0.0;
    let mut count = 0;
    for w in toks.chunks(l) {
        if w.len() >= 2 {
            nll += window_nll_f64(&model, &params64, w);
            count += w.len() - 1;
        }
    }
    assert_eq!(count, 18);
    let reference = nll / count as f64;

    let r = run(&model, &params32, &toks, &opts(l, 2));
    assert_eq!(r.tokens, 18);
    assert_eq!(r.windows, 5);
    let rel = (r.loss - reference).abs() / reference;
    assert!(
        rel < 1e-5,
        "eval {} vs f64 reference {reference}: rel {rel:e}",
        r.loss
    );
    assert!((r.perplexity - r.loss.exp()).abs() <= 1e-12 * r.perplexity);

    // The training head's mean loss (f32, candle ops), window by window,
    // weighted by predictions: a second, different computation.
    let mut head_sum = 0.0;
    for w in toks.chunks(l).filter(|w| w.len() >= 2) {
        let t = w.len() - 1;
        let ids = Tensor::from_vec(w[..t].to_vec(), (1, t), &Device::Cpu).unwrap();
        let tg = Tensor::from_vec(w[1..].to_vec(), (1, t), &Device::Cpu).unwrap();
        let mean = model
            .forward_full(&params32, &ids, &tg)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        head_sum += f64::from(mean) * t as f64;
    }
    let head = head_sum / count as f64;
    assert!(
        (r.loss - head).abs() / head < 1e-5,
        "eval {} vs training head {head}",
        r.loss
    );

    // Windows per forward change nothing but memory.
    for batch in [1, 3, 100] {
        let b = run(&model, &params32, &toks, &opts(l, batch));
        assert_eq!(b.tokens, r.tokens);
        // The same bits: each window's logits are the same whatever the
        // batch, and the f64 sum is one chain in window order.
        assert_eq!(
            b.loss.to_bits(),
            r.loss.to_bits(),
            "batch {batch}: {} vs {}",
            b.loss,
            r.loss
        );
    }
}

#[test]
fn gpt2_loss_matches_f64_log_softmax_reference() {
    check_against_reference(gpt2_config(true));
    check_against_reference(gpt2_config(false));
}

#[test]
fn llama_loss_matches_f64_log_softmax_reference() {
    check_against_reference(llama_config(false));
}

#[test]
fn a_single_trailing_token_is_dropped_and_counts_follow_the_windows() {
    let model = Model::new(gpt2_config(true)).unwrap();
    let params = random_params(&model, 3, DType::F32);
    let toks = tokens(21, 11);
    // 21 = 4 * 5 + 1: the last token has nothing to be predicted from, so
    // the result equals the one over the first 20 tokens exactly.
    let a = run(&model, &params, &toks, &opts(5, 4));
    let b = run(&model, &params, &toks[..20], &opts(5, 4));
    assert_eq!((a.tokens, a.windows), (16, 4));
    assert_eq!(a, b);
    // Exactly one window.
    let c = run(&model, &params, &toks[..6], &opts(6, 1));
    assert_eq!((c.tokens, c.windows), (5, 1));
    // Fewer tokens than one window: one partial window, the same as a
    // window of that length (it was refused).
    let d = run(&model, &params, &toks[..4], &opts(6, 2));
    let e = run(&model, &params, &toks[..4], &opts(4, 1));
    assert_eq!((d.tokens, d.windows), (3, 1));
    assert_eq!(d, e);
}

#[test]
fn bad_inputs_are_errors_naming_the_numbers() {
    let model = Model::new(gpt2_config(true)).unwrap(); // vocab 11, 6 positions
    let params = random_params(&model, 3, DType::F32);
    let eval = |toks: &[u32], o: EvalOptions| {
        evaluate(
            &model,
            |id| Ok::<_, ModelError>(params[id.0].clone()),
            toks,
            &o,
        )
        .unwrap_err()
    };
    let toks = tokens(30, 11);
    let e = eval(&toks, opts(1, 1));
    assert!(matches!(e, EvalError::SeqLenTooSmall { seq_len: 1 }), "{e}");
    let e = eval(&toks, opts(7, 1));
    assert!(
        matches!(
            e,
            EvalError::SeqLenTooLarge {
                seq_len: 7,
                max_seq_len: 6
            }
        ),
        "{e}"
    );
    let e = eval(&toks[..1], opts(5, 1));
    assert!(
        matches!(
            e,
            EvalError::TooFewTokens {
                tokens: 1,
                seq_len: 5
            }
        ),
        "{e}"
    );
    let mut oov = toks.clone();
    oov[17] = 11;
    let e = eval(&oov, opts(5, 1));
    assert!(
        matches!(
            e,
            EvalError::TokenOutOfVocab {
                token: 11,
                position: 17,
                vocab_size: 11
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("11") && e.to_string().contains("vocab_size"));
    let e = eval(&toks, opts(5, 0));
    assert!(matches!(e, EvalError::ZeroBatch), "{e}");
    // The weight source's error names the parameter.
    let e = evaluate(
        &model,
        |id| {
            if id.0 == 2 {
                Err(ModelError::MissingTensor {
                    name: "h.0.ln_1.weight".into(),
                    hint: String::new(),
                })
            } else {
                Ok(params[id.0].clone())
            }
        },
        &toks,
        &opts(5, 1),
    )
    .unwrap_err();
    let name = model.params()[2].name.clone();
    assert!(
        matches!(&e, EvalError::Fetch { name: n, .. } if *n == name),
        "{e}"
    );
}

/// The weights stream unit by unit: each pass fetches every unit's params
/// in unit order (a tied embedding once per unit that uses it), and the
/// passes (`pass_bytes`) change how often the weights are read, never the
/// result's bits.
#[test]
fn weights_stream_unit_by_unit_and_passes_change_only_how_often_they_are_read() {
    for cfg in [gpt2_config(true), gpt2_config(false), llama_config(false)] {
        let model = Model::new(cfg).unwrap();
        let vocab = model.config().vocab_size;
        let params = random_params(&model, 5, DType::F32);
        // L = 5 over 23 tokens: 4 full windows, then a partial one. Batches
        // of 2: [2 windows][2 windows][partial].
        let toks = tokens(23, vocab);
        let one_pass: Vec<usize> = model
            .units()
            .iter()
            .flat_map(|u| u.params.iter().map(|p| p.0))
            .collect();
        // Batches of 1 with a pass of two batches' hidden states: passes
        // [1 2][3 4][partial], so a sum grouped by pass would differ from
        // one grouped by batch of 2 or by nothing.
        let two_batches_of_one = 2 * 4 * model.config().hidden_size as u64 * 4;
        let mut results = Vec::new();
        for (batch, pass_bytes, passes) in [
            (2, u64::MAX, 1),
            (2, 1, 3),
            (1, two_batches_of_one, 3),
            (1, u64::MAX, 1),
        ] {
            let mut fetched = Vec::new();
            let o = EvalOptions {
                pass_bytes,
                ..opts(5, batch)
            };
            let r = evaluate(
                &model,
                |id| {
                    fetched.push(id.0);
                    Ok::<_, ModelError>(params[id.0].clone())
                },
                &toks,
                &o,
            )
            .unwrap();
            assert_eq!(
                fetched,
                one_pass.repeat(passes),
                "batch {batch}, pass_bytes {pass_bytes}"
            );
            results.push(r);
        }
        for r in &results[1..] {
            assert_eq!(r.loss.to_bits(), results[0].loss.to_bits());
            assert_eq!(*r, results[0]);
        }
        assert_eq!(results[0].tokens, 18);
    }
}
