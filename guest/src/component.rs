//! The component's exports: translates between the WIT types and the engine. Nothing else in
//! the crate names generated types.

use crate::bindings::exports::wisp::llm::engine as wit;
use crate::bindings::wisp::llm::gpu;
use crate::dispatch::{self, AttentionShape, DeviceError, DeviceLimits, DeviceOutput, DeviceSequence, Format, Mode};
use crate::program::{Op, Rotation};
use crate::chat;
use crate::constraint::Spec;
use crate::engine::{DeviceOffer, Error, Model};
use crate::kernels::Act;
use crate::embedding::Pooling;
use crate::sampler::Params;
use crate::session::{self, Advance, Session};
use crate::source::{FileSource, Source};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

pub struct Component;

impl From<Error> for wit::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::InvalidModel(m) => wit::Error::InvalidModel(m),
            Error::Unsupported(m) => wit::Error::Unsupported(m),
            Error::Io(m) => wit::Error::Io(m),
            Error::InvalidArgument(m) => wit::Error::InvalidArgument(m),
            Error::ContextFull(m) => wit::Error::ContextFull(m),
            Error::OutOfMemory(m) => wit::Error::OutOfMemory(m),
            Error::InvalidConstraint(m) => wit::Error::InvalidConstraint(m),
        }
    }
}

pub struct ModelRes {
    model: Rc<Model>,
    device: Option<gpu::DeviceInfo>,
    /// `precision: fast` (the load option): its sessions' CPU products take int8 activations.
    fast: bool,
    /// The chat template in use: the model's, until a host sets another.
    template: RefCell<Option<chat::Template>>,
}

impl ModelRes {
    fn new(model: Rc<Model>, device: Option<gpu::DeviceInfo>, precision: gpu::Precision) -> ModelRes {
        let template = RefCell::new(model.chat_template.clone());
        ModelRes { model, device, fast: precision == gpu::Precision::Fast, template }
    }
}

pub struct SessionRes(RefCell<Session>);

impl wit::Guest for Component {
    type Model = ModelRes;
    type Session = SessionRes;
}

/// The host's `gpu` imports as the dispatcher's `Device`: ids index the weight handles.
struct HostGpu {
    /// The precision of the products and attention of the programs made here (the model's
    /// load option; the guest's own CPU kernels take it too: `ModelRes::fast`).
    precision: gpu::Precision,
    weights: RefCell<Vec<Option<gpu::Weight>>>,
    caches: RefCell<Vec<Option<gpu::KvCache>>>,
    programs: RefCell<Vec<gpu::Program>>,
    /// The programs of one op that serve the products and attention of a model that runs on
    /// the guest's CPU with some of its work on the device (made on first use, kept by what
    /// they compute; a program of products goes when one of its weights does).
    small: RefCell<HashMap<Small, gpu::Program>>,
}

/// What a program of [`HostGpu::small`] computes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Small {
    /// The products of one input with these weights (ids of `HostGpu::weights`).
    Products(Vec<usize>),
    /// Keys and values of this width written to a cache.
    Write(u32),
    /// Keys and values written to a cache, then attention over it: heads, key/value heads,
    /// head width, window and the bits of the scale and of the soft cap.
    Attend([u32; 6]),
}

impl From<gpu::Error> for DeviceError {
    fn from(e: gpu::Error) -> Self {
        match e {
            gpu::Error::Unavailable(m) => DeviceError::Unavailable(m),
            gpu::Error::InvalidArgument(m) => DeviceError::InvalidArgument(m),
            gpu::Error::OutOfMemory(m) => DeviceError::OutOfMemory(m),
            gpu::Error::DeviceLost(m) => DeviceError::Lost(m),
        }
    }
}

impl HostGpu {
    /// Runs the program `key` names, made first from `ops()` over the weights `weights` and
    /// `caches` cache indices if there is none yet: the rows of its outputs.
    fn run_small(
        &self,
        key: Small,
        weights: &[usize],
        caches: u32,
        ops: impl FnOnce() -> Vec<gpu::Op>,
        inputs: &[Vec<f32>],
        batch: &[gpu::Sequence<'_>],
    ) -> Result<Vec<Vec<f32>>, DeviceError> {
        if !self.small.borrow().contains_key(&key) {
            let ws = self.weights.borrow();
            let handles = weights.iter().map(|&id| weight(&ws, id)).collect::<Result<Vec<&gpu::Weight>, _>>()?;
            let p = gpu::create_program(&handles, caches, &ops())?;
            self.small.borrow_mut().insert(key.clone(), p);
        }
        let small = self.small.borrow();
        Ok(rows(small[&key].run(inputs, batch)?))
    }
}

/// The rows of a run's `output` ops, in order.
fn rows(outs: Vec<gpu::Output>) -> Vec<Vec<f32>> {
    outs.into_iter()
        .filter_map(|o| match o {
            gpu::Output::Rows(v) => Some(v),
            gpu::Output::Top(_) => None,
        })
        .collect()
}

impl dispatch::Device for HostGpu {
    fn allocate(&self, format: Format, n_out: u32, n_in: u32) -> Result<usize, DeviceError> {
        let format = match format {
            Format::F32 => gpu::WeightFormat::F32,
            Format::Bf16 => gpu::WeightFormat::Bf16,
            Format::Q8x32 => gpu::WeightFormat::Q8x32,
            Format::Q8x16 => gpu::WeightFormat::Q8x16,
            Format::Q4x32 => gpu::WeightFormat::Q4x32,
        };
        let w = gpu::allocate(format, n_out, n_in)?;
        let mut ws = self.weights.borrow_mut();
        ws.push(Some(w));
        Ok(ws.len() - 1)
    }

    fn write_rows(&self, id: usize, first_row: u32, data: &[u8], scales: &[f32]) -> Result<(), DeviceError> {
        Ok(weight(&self.weights.borrow(), id)?.write_rows(first_row, data, scales)?)
    }

    /// A program of `[input, matmul.., output..]` over the jobs' weights.
    fn matmul(&self, x: &[f32], t: u32, n_in: u32, jobs: &[usize]) -> Result<Vec<Vec<f32>>, DeviceError> {
        let key = Small::Products(jobs.to_vec());
        let n = jobs.len() as u32;
        let ops = || {
            let products = (0..n).map(|j| gpu::Op::Matmul(gpu::MatmulOp { x: 0, weight: j, precision: self.precision }));
            std::iter::once(gpu::Op::Input(n_in)).chain(products).chain((1..=n).map(gpu::Op::Output)).collect()
        };
        let one = [gpu::Sequence { rows: t, start: 0, caches: Vec::new() }];
        self.run_small(key, jobs, 0, ops, &[x.to_vec()], &one)
    }

    fn free(&self, id: usize) {
        if let Some(w) = self.weights.borrow_mut().get_mut(id) {
            w.take();
        }
        self.small.borrow_mut().retain(|k, _| !matches!(k, Small::Products(ids) if ids.contains(&id)));
    }

    fn create_kv_cache(&self, slots: u32, width: u32) -> Result<usize, DeviceError> {
        let c = gpu::create_kv_cache(slots, width)?;
        let mut cs = self.caches.borrow_mut();
        cs.push(Some(c));
        Ok(cs.len() - 1)
    }

    fn free_kv_cache(&self, id: usize) {
        if let Some(c) = self.caches.borrow_mut().get_mut(id) {
            c.take();
        }
    }

    fn attention_cached(
        &self,
        q: &[f32],
        k_new: &[f32],
        v_new: &[f32],
        first_new: u32,
        cache: usize,
        first_key: u32,
        s: &AttentionShape,
    ) -> Result<Vec<f32>, DeviceError> {
        let width = s.n_head_kv * s.head_dim;
        let (t, rows) = (s.t, (k_new.len() / width.max(1) as usize) as u32);
        // The queries' first position; the keys sent are the rows before them and theirs.
        let pos = (first_new + rows).checked_sub(t).unwrap_or(u32::MAX);
        let first_seen = if s.window == 0 { 0 } else { (pos + 1).saturating_sub(s.window) };
        if rows < t || k_new.len() != v_new.len() || first_key != first_seen || s.n_keys != pos + t - first_key {
            return Err(DeviceError::InvalidArgument("attention's keys are not the rows before its queries".into()));
        }
        let cs = self.caches.borrow();
        let seq = |rows: u32, start: u32| Ok::<_, DeviceError>([gpu::Sequence { rows, start, caches: vec![kv_cache(&cs, cache)?] }]);
        let at = |i: u32| i as usize * width as usize;
        if rows > t {
            // The rows the device lacks before the queries': written by a program of their own
            // (it outputs the last one: a program outputs something).
            let ops = || {
                vec![
                    gpu::Op::Input(width),
                    gpu::Op::Input(width),
                    gpu::Op::CacheWrite(gpu::CacheWriteOp { k: 0, v: 1, cache: 0 }),
                    gpu::Op::LastRows(0),
                    gpu::Op::Output(3),
                ]
            };
            let lack = [k_new[..at(rows - t)].to_vec(), v_new[..at(rows - t)].to_vec()];
            self.run_small(Small::Write(width), &[], 1, ops, &lack, &seq(rows - t, first_new)?)?;
        }
        let key = Small::Attend([s.n_head, s.n_head_kv, s.head_dim, s.window, s.scale.to_bits(), s.softcap.to_bits()]);
        let ops = || {
            let attention = gpu::AttentionOp {
                q: 0,
                cache: 0,
                n_head: s.n_head,
                n_head_kv: s.n_head_kv,
                head_dim: s.head_dim,
                window: s.window,
                scale: s.scale,
                softcap: s.softcap,
                precision: self.precision,
            };
            vec![
                gpu::Op::Input(s.n_head * s.head_dim),
                gpu::Op::Input(width),
                gpu::Op::Input(width),
                gpu::Op::CacheWrite(gpu::CacheWriteOp { k: 1, v: 2, cache: 0 }),
                gpu::Op::Attention(attention),
                gpu::Op::Output(4),
            ]
        };
        let inputs = [q.to_vec(), k_new[at(rows - t)..].to_vec(), v_new[at(rows - t)..].to_vec()];
        // A host that answers with no rows answers with the wrong shape (the dispatcher's
        // check of the length then stops using it), not with a trap here.
        let outs = self.run_small(key, &[], 1, ops, &inputs, &seq(t, pos)?)?;
        Ok(outs.into_iter().next().unwrap_or_default())
    }

    fn create_program(&self, weights: &[usize], caches: u32, ops: &[Op]) -> Result<usize, DeviceError> {
        let ws = self.weights.borrow();
        let handles = weights.iter().map(|&id| weight(&ws, id)).collect::<Result<Vec<&gpu::Weight>, _>>()?;
        let ops: Vec<gpu::Op> = ops.iter().map(|op| wit_op(op, self.precision)).collect();
        let p = gpu::create_program(&handles, caches, &ops)?;
        let mut ps = self.programs.borrow_mut();
        ps.push(p);
        Ok(ps.len() - 1)
    }

    fn run_program(&self, id: usize, inputs: &[Vec<f32>], batch: &[DeviceSequence<'_>]) -> Result<Vec<DeviceOutput>, DeviceError> {
        let (ps, cs) = (self.programs.borrow(), self.caches.borrow());
        let p = ps.get(id).ok_or_else(|| DeviceError::InvalidArgument(format!("no program {id}")))?;
        let mut seqs = Vec::with_capacity(batch.len());
        for s in batch {
            let caches = s.caches.iter().map(|&c| kv_cache(&cs, c)).collect::<Result<Vec<_>, _>>()?;
            seqs.push(gpu::Sequence { rows: s.rows, start: s.start, caches });
        }
        let outs = p.run(inputs, &seqs)?;
        Ok(outs
            .into_iter()
            .map(|o| match o {
                gpu::Output::Rows(v) => DeviceOutput::Rows(v),
                gpu::Output::Top(t) => DeviceOutput::Top { values: t.values, indices: t.indices },
            })
            .collect())
    }
}

/// An op core op as the WIT's (its weights index the program's weights), products and
/// attention at `precision` (the model's load option).
fn wit_op(op: &Op, precision: gpu::Precision) -> gpu::Op {
    // Value and weight indices: a program of more than u32's ops is refused by the op core.
    let v = |x: usize| x as u32;
    match *op {
        Op::Input { width } => gpu::Op::Input(width),
        Op::Matmul { x, weight, .. } => gpu::Op::Matmul(gpu::MatmulOp { x: v(x), weight: v(weight), precision }),
        Op::RmsNorm { x, weight, offset, group, eps } => gpu::Op::RmsNorm(gpu::NormOp { x: v(x), weight: weight.map(v), offset, group, eps }),
        Op::Add(a, b) => gpu::Op::Add((v(a), v(b))),
        Op::Mul(a, b) => gpu::Op::Mul((v(a), v(b))),
        Op::Bias { x, weight } => gpu::Op::Bias(gpu::BiasOp { x: v(x), weight: v(weight) }),
        Op::Scale { x, by } => gpu::Op::Scale(gpu::ScaleOp { x: v(x), by }),
        Op::Softcap { x, cap } => gpu::Op::Softcap(gpu::SoftcapOp { x: v(x), cap }),
        Op::Gated { gate, up, act } => gpu::Op::Gated(gpu::GatedOp {
            gate: v(gate),
            up: v(up),
            act: match act {
                Act::GeluTanh => gpu::Activation::GeluTanh,
                Act::Silu => gpu::Activation::Silu,
            },
        }),
        Op::Rotate { x, table, head_dim, rotation } => gpu::Op::Rotate(gpu::RotateOp {
            x: v(x),
            table: v(table),
            head_dim,
            rotation: match rotation {
                Rotation::Halves => gpu::Rotation::Halves,
                Rotation::Pairs => gpu::Rotation::Pairs,
            },
        }),
        Op::CacheWrite { k, v: vv, cache } => gpu::Op::CacheWrite(gpu::CacheWriteOp { k: v(k), v: v(vv), cache }),
        Op::Attention { q, cache, n_head, n_head_kv, head_dim, window, scale, softcap, .. } => {
            gpu::Op::Attention(gpu::AttentionOp { q: v(q), cache, n_head, n_head_kv, head_dim, window, scale, softcap, precision })
        }
        Op::LastRows(x) => gpu::Op::LastRows(v(x)),
        Op::Output(x) => gpu::Op::Output(v(x)),
        Op::TopK { x, k } => gpu::Op::TopK(gpu::TopKOp { x: v(x), k }),
    }
}

/// The live weight `id` of this instance's list, or `invalid-argument`.
fn weight(ws: &[Option<gpu::Weight>], id: usize) -> Result<&gpu::Weight, DeviceError> {
    ws.get(id).and_then(|w| w.as_ref()).ok_or_else(|| DeviceError::InvalidArgument(format!("no weight {id}")))
}

/// The live kv-cache `id` of this instance's list, or `invalid-argument`.
fn kv_cache(cs: &[Option<gpu::KvCache>], id: usize) -> Result<&gpu::KvCache, DeviceError> {
    cs.get(id).and_then(|c| c.as_ref()).ok_or_else(|| DeviceError::InvalidArgument(format!("no kv-cache {id}")))
}


thread_local! {
    /// The model `preload` loaded, and its path (a pre-initialized guest starts with it).
    static PRELOADED: RefCell<Option<(String, Rc<Model>)>> = const { RefCell::new(None) };
}

unsafe extern "C" {
    /// wasi-libc: forgets the preopened directories it has looked up, so that the next file
    /// access asks the host again (their handles belong to the instance that looked them up).
    fn __wasilibc_reset_preopens();
}

impl crate::bindings::Guest for Component {
    fn preload(path: String) -> Result<(), String> {
        // A piece at a time, as `open` reads: the snapshot is the converted weights laid end to
        // end, with no hole where a whole file's copy was freed, so that a runtime maps it
        // copy-on-write with its default settings (wasmtime wants the data to be at least half
        // of the range it spans) and copies no zeros into each instance's image.
        let model = (|| -> Result<Model, wit::Error> {
            let file = FileSource::open(&path).map_err(Error::from)?;
            let g = file.header().map_err(Error::from)?;
            Ok(Model::load_from(g, &file, None)?)
        })()
        .map_err(|e| match e {
            wit::Error::InvalidModel(m)
            | wit::Error::Unsupported(m)
            | wit::Error::Io(m)
            | wit::Error::InvalidArgument(m)
            | wit::Error::ContextFull(m)
            | wit::Error::OutOfMemory(m)
            | wit::Error::InvalidConstraint(m) => m,
        })?;
        // The constraint compiler's view of the vocabulary (~2 s to build in wasm for 262,144
        // tokens) goes into the snapshot too; a model without an end token has none, and says
        // so when a constraint is asked for.
        let _ = model.grammars();
        // SAFETY: no file or directory of wasi-libc's is in use here (the model file is closed).
        unsafe { __wasilibc_reset_preopens() };
        PRELOADED.with(|p| *p.borrow_mut() = Some((path, Rc::new(model))));
        Ok(())
    }

    fn preloaded_model() -> Option<String> {
        PRELOADED.with(|p| p.borrow().as_ref().map(|(path, _)| path.clone()))
    }
}

/// The preloaded model, if it is `path`'s and the guest will not use a device for it.
fn preloaded(path: &str, options: &wit::LoadOptions) -> Option<wit::Model> {
    if !(matches!(options.gpu, wit::GpuMode::Off) || gpu::available().is_none()) {
        return None;
    }
    let model = PRELOADED.with(|p| p.borrow().as_ref().filter(|(p, _)| p == path).map(|(_, m)| m.clone()))?;
    Some(wit::Model::new(ModelRes::new(model, None, options.precision)))
}

/// Loads a model from `file` (its bytes in memory, or the file read a piece at a time), with
/// the host's device offered as `options` say.
fn open(file: &dyn Source, options: wit::LoadOptions) -> Result<wit::Model, wit::Error> {
    let device = gpu::available();
    let mode = match options.gpu {
        wit::GpuMode::Off => Mode::Off,
        wit::GpuMode::Auto => Mode::Auto,
        wit::GpuMode::On => Mode::On,
    };
    let offer = device.as_ref().map(|d| DeviceOffer {
        mode,
        device: Box::new(HostGpu {
                precision: options.precision,
                weights: RefCell::new(Vec::new()),
                caches: RefCell::new(Vec::new()),
                programs: RefCell::new(Vec::new()),
                small: RefCell::new(HashMap::new()),
            }),
        limits: DeviceLimits {
            name: d.name.clone(),
            max_weight_bytes: d.max_weight_bytes,
            max_activation_elements: d.max_activation_elements,
            budget_bytes: d.budget_bytes,
            budget_handles: d.budget_handles,
        },
        weights_on_device: false,
    });
    let g = file.header().map_err(Error::from)?;
    let model = Model::load_from(g, file, offer)?;
    Ok(wit::Model::new(ModelRes::new(Rc::new(model), device, options.precision)))
}

impl wit::GuestModel for ModelRes {
    fn open(path: String, options: wit::LoadOptions) -> Result<wit::Model, wit::Error> {
        if let Some(m) = preloaded(&path, &options) {
            return Ok(m);
        }
        // Read a piece at a time: the guest holds the converted weights, not the file too.
        open(&FileSource::open(&path).map_err(Error::from)?, options)
    }

    fn from_bytes(bytes: Vec<u8>, options: wit::LoadOptions) -> Result<wit::Model, wit::Error> {
        open(&bytes.as_slice(), options)
    }

    fn info(&self) -> wit::ModelInfo {
        let s = &self.model.summary;
        let t = &self.model.tokenizer;
        wit::ModelInfo {
            architecture: s.architecture.clone(),
            name: s.name.clone(),
            n_params: s.n_params,
            n_layers: s.n_layers,
            n_embd: s.n_embd,
            n_vocab: s.n_vocab,
            n_ctx_train: s.n_ctx_train,
            file_bytes: s.file_bytes,
            tokenizer: t.model_name.clone(),
            bos: t.bos,
            eos: t.eos,
            tensors: s
                .tensors
                .iter()
                .map(|(name, kind, dims, bytes)| wit::TensorInfo {
                    name: name.clone(),
                    kind: kind.to_string(),
                    shape: dims.clone(),
                    bytes: *bytes,
                })
                .collect(),
            metadata: s.metadata.clone(),
            device: self.device.clone(),
            gpu_weights: self.model.gpu_weights as u32,
            chat_template: self.template.borrow().as_ref().map(|t| match t.origin {
                chat::Origin::File => wit::ChatTemplate::File,
                chat::Origin::Builtin(name) => wit::ChatTemplate::Builtin(name.to_string()),
                chat::Origin::Custom => wit::ChatTemplate::Custom,
            }),
        }
    }

    fn tokenize(&self, text: String, add_special: bool, parse_special: bool) -> Result<Vec<u32>, wit::Error> {
        Ok(self.model.tokenizer.encode(&text, add_special, parse_special))
    }

    fn token_piece(&self, token: u32, special: bool) -> Result<Vec<u8>, wit::Error> {
        self.check_token(token)?;
        Ok(self.model.tokenizer.piece(token, special))
    }

    fn detokenize(&self, tokens: Vec<u32>, special: bool) -> Result<String, wit::Error> {
        for &t in &tokens {
            self.check_token(t)?;
        }
        Ok(self.model.tokenizer.decode(&tokens, special))
    }

    fn is_end_of_generation(&self, token: u32) -> bool {
        self.model.tokenizer.is_eog(token)
    }

    fn apply_chat_template(&self, messages: Vec<(String, String)>, add_generation_prompt: bool) -> Result<String, wit::Error> {
        let template = self.template.borrow();
        let template = template.as_ref().ok_or_else(|| wit::Error::Unsupported("the model has no chat template".into()))?;
        Ok(template.render(&messages, add_generation_prompt)?)
    }

    fn render_chat(&self, conversation: String, add_generation_prompt: bool) -> Result<wit::RenderedChat, wit::Error> {
        let template = self.template.borrow();
        let template = template.as_ref().ok_or_else(|| wit::Error::Unsupported("the model has no chat template".into()))?;
        let (text, syntax) = template.render_conversation(&conversation, add_generation_prompt)?;
        let tool_syntax = match syntax {
            chat::ToolSyntax::Hermes => wit::ToolSyntax::Hermes,
            chat::ToolSyntax::Llama3Json => wit::ToolSyntax::Llama3Json,
        };
        Ok(wit::RenderedChat { text, tool_syntax })
    }

    fn set_chat_template(&self, template: String) -> Result<(), wit::Error> {
        let t = chat::Template::named_or_source(&template, &self.model.tokenizer)?;
        *self.template.borrow_mut() = Some(t);
        Ok(())
    }

    fn embed(&self, texts: Vec<Vec<u32>>, pooling: wit::Pooling) -> Result<Vec<Vec<f32>>, wit::Error> {
        let pooling = match pooling {
            wit::Pooling::Mean => Pooling::Mean,
            wit::Pooling::Last => Pooling::Last,
            wit::Pooling::Cls => Pooling::Cls,
        };
        Ok(self.model.embed(&texts, pooling, self.fast)?)
    }

    fn new_session(&self, n_ctx: u32) -> Result<wit::Session, wit::Error> {
        let mut s = Session::new(Rc::clone(&self.model), n_ctx as usize)?;
        s.set_fast(self.fast);
        Ok(wit::Session::new(SessionRes(RefCell::new(s))))
    }

    fn step(&self, work: Vec<wit::Advance<'_>>) -> Result<Vec<Result<Option<wit::Step>, wit::Error>>, wit::Error> {
        if work.len() > MAX_STEP {
            return Err(wit::Error::InvalidArgument(format!("{} sessions in one step; at most {MAX_STEP}", work.len())));
        }
        let sessions: Vec<&SessionRes> = work.iter().map(|a| a.session.get::<SessionRes>()).collect();
        for (i, s) in sessions.iter().enumerate() {
            if sessions[..i].iter().any(|o| std::ptr::eq(*o, *s)) {
                return Err(wit::Error::InvalidArgument(format!("entry {i}'s session is also an earlier entry's")));
            }
            if !s.0.borrow().belongs_to(&self.model) {
                return Err(wit::Error::InvalidArgument(format!("entry {i}'s session belongs to another model")));
            }
        }
        let mut guards: Vec<_> = sessions.iter().map(|s| s.0.borrow_mut()).collect();
        let mut advances: Vec<Advance<'_>> = guards
            .iter_mut()
            .zip(&work)
            .map(|(g, a)| Advance { session: &mut **g, tokens: &a.tokens, sample: a.sample.map(Params::from) })
            .collect();
        let results = session::step(&self.model, self.fast, &mut advances);
        Ok(results.into_iter().map(|r| r.map(|s| s.map(wit_step)).map_err(wit::Error::from)).collect())
    }
}

/// Sessions one `model.step` advances at most.
const MAX_STEP: usize = 1024;

fn wit_step(step: session::Step) -> wit::Step {
    wit::Step {
        token: step.token,
        piece: step.piece,
        end_of_generation: step.end_of_generation,
        dead_end: step.dead_end,
        logprobs: step.logprobs.map(|(logprob, top)| wit::Logprobs { logprob, top }),
    }
}

impl ModelRes {
    fn check_token(&self, token: u32) -> Result<(), wit::Error> {
        let n = self.model.n_vocab();
        if (token as usize) < n {
            Ok(())
        } else {
            Err(wit::Error::InvalidArgument(format!("token id {token} is not below the vocabulary size {n}")))
        }
    }
}

impl From<wit::Sampling> for Params {
    fn from(s: wit::Sampling) -> Params {
        Params {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            min_p: s.min_p,
            repeat_penalty: s.repeat_penalty,
            repeat_last_n: s.repeat_last_n,
            seed: s.seed,
            logprobs: s.logprobs,
        }
    }
}

impl wit::GuestSession for SessionRes {
    fn feed(&self, tokens: Vec<u32>) -> Result<(), wit::Error> {
        Ok(self.0.borrow_mut().feed(&tokens)?)
    }

    fn next(&self, sampling: wit::Sampling) -> Result<wit::Step, wit::Error> {
        Ok(wit_step(self.0.borrow_mut().next(&sampling.into())?))
    }

    fn constrain(&self, constraint: Option<wit::Constraint>) -> Result<(), wit::Error> {
        let spec = constraint.map(|c| match c {
            wit::Constraint::JsonSchema(s) => Spec::JsonSchema(s),
            wit::Constraint::Regex(s) => Spec::Regex(s),
            wit::Constraint::Lark(s) => Spec::Lark(s),
        });
        Ok(self.0.borrow_mut().constrain(spec.as_ref())?)
    }

    fn logits(&self) -> Result<Vec<f32>, wit::Error> {
        Ok(self.0.borrow_mut().logits()?.to_vec())
    }

    fn top(&self, k: u32) -> Result<Vec<(u32, f32)>, wit::Error> {
        let mut s = self.0.borrow_mut();
        let logits = s.logits()?;
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let k = (k as usize).min(idx.len());
        let by = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
        if k > 0 && k < idx.len() {
            idx.select_nth_unstable_by(k - 1, by);
        }
        idx.truncate(k);
        idx.sort_unstable_by(by);
        Ok(idx.into_iter().map(|i| (i, logits[i as usize])).collect())
    }

    fn position(&self) -> u32 {
        self.0.borrow().position() as u32
    }

    fn capacity(&self) -> u32 {
        self.0.borrow().capacity() as u32
    }

    fn reset(&self) {
        self.0.borrow_mut().reset()
    }

    fn truncate(&self, tokens: u32) -> Result<(), wit::Error> {
        Ok(self.0.borrow_mut().truncate(tokens as usize)?)
    }

    fn fork(&self, tokens: u32) -> Result<wit::Session, wit::Error> {
        let s = self.0.borrow().fork(tokens as usize)?;
        Ok(wit::Session::new(SessionRes(RefCell::new(s))))
    }

    fn stats(&self) -> wit::Stats {
        let s = self.0.borrow().stats();
        let d = s.dispatch;
        wit::Stats {
            prefill_tokens: s.prefill_tokens,
            prefill_ns: s.prefill_ns,
            decode_tokens: s.decode_tokens,
            decode_ns: s.decode_ns,
            cpu_matmuls: d.cpu_matmuls,
            cpu_flops: d.cpu_flops,
            gpu_calls: d.gpu_calls,
            gpu_flops: d.gpu_flops,
            gpu_ns: d.gpu_ns,
            gpu_fallbacks: d.gpu_fallbacks,
            cpu_ns: d.cpu_ns,
            cpu_bytes: d.cpu_bytes,
            attention_ns: d.attention_ns,
            gpu_attention_calls: d.gpu_attention_calls,
            output_ns: d.output_ns,
        }
    }
}
