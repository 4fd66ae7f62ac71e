// Types of wisp-web's API (src/index.js).

/** Where the matrix products may run: `auto` lets the engine choose. */
export type GpuMode = 'auto' | 'on' | 'off';
/** `exact` keeps f32 results the same on every host; `fast` rounds products' inputs (int8 activations on the CPU, f16 on GPUs with cooperative matrices), held to the golden thresholds. */
export type Precision = 'exact' | 'fast';

/** A model: its URL, and optionally its sha256 (then the cache is looked up by it, and a download must match it). */
export type ModelSource = string | URL | { url: string; sha256?: string; name?: string };

export interface LoadProgress {
  /** `download` (from the network), `cache` (from Cache Storage), `load` (into the engine). */
  phase: 'download' | 'cache' | 'load';
  loaded: number;
  /** 0 when the server gave no length. */
  total: number;
}

export interface EngineOptions {
  model: ModelSource;
  gpu?: GpuMode;
  precision?: Precision;
  /** Tokens a completion may span, prompt and output (default 2048, at most the model's training context). */
  contextSize?: number;
  onProgress?: (progress: LoadProgress) => void;
  /** Aborts loading. */
  signal?: AbortSignal;
  /** `false` runs as a browser without JSPI would (the guest cannot wait for WebGPU: the CPU). */
  jspi?: boolean;
  /** `false` runs without WebGPU (the CPU). */
  webgpu?: boolean;
  /** The gemv kernel's lanes per row (a tuning knob; the default suits most devices). */
  lanes?: number;
  /** Caps what one WebGPU storage binding may span below the adapter's limit (at least 65536
   *  bytes): a weight past it is held in parts of whole rows, as on a device whose binding is
   *  that small. For tests and comparison. */
  maxBindingBytes?: number;
  /** How `embeddings.create` makes one vector of a text's tokens' hidden states (as llama-server's `--pooling`): their mean (the default), the last token's or the first's. */
  pooling?: 'mean' | 'last' | 'cls';
}

export interface EngineEnv {
  jspi: boolean;
  webgpu: boolean;
  /** The transpilation in use: `jspi`, or `sync` without JSPI. */
  variant: 'jspi' | 'sync';
  /** What this browser lacks and what the engine does instead, as sentences. */
  notices: string[];
  /** The component the engine runs: the sha256 of the same .wasm the native host runs. */
  component: { sha256: string; bytes: number; jco: string };
}

export interface DeviceInfo {
  name: string;
  backend: string;
  deviceType: string;
}

export interface LoadedModel {
  /** The name responses carry in `model`. */
  id: string;
  url: string;
  sha256: string;
  fromCache: boolean;
  bytes: number;
  loadMs: number;
  architecture: string;
  name: string;
  nParams: number;
  nLayers: number;
  nVocab: number;
  nCtxTrain: number;
  contextSize: number;
  /** `file` (the GGUF's own), `builtin:NAME`, `custom`, or null (no chat template: chat completions fail). */
  chatTemplate: string | null;
  /** The WebGPU device the weights went to, or null (the CPU). */
  device: DeviceInfo | null;
  gpuWeights: number;
  /** The guest's linear memory after the load, in bytes. The guest reads the model a piece at a
   *  time; with `gpu: 'on'` and a WebGPU device that holds every weight, it keeps none of them,
   *  and this stays far below `bytes`. */
  guestMemoryBytes: number;
  gpu: GpuMode;
  precision: Precision;
}

export interface ChatMessage {
  role: 'system' | 'user' | 'assistant' | (string & {});
  content: string | Array<{ type: 'text'; text: string }>;
}

/** JSON schema, regular expression or Lark grammar: at most one of them. */
export type ResponseFormat =
  | { type: 'text' }
  | { type: 'json_object'; schema?: object }
  | { type: 'json_schema'; json_schema: { name?: string; schema?: object | boolean; strict?: boolean } };

interface CommonParams {
  /** Tokens to generate at most (default: to the end of the context). */
  max_tokens?: number;
  max_completion_tokens?: number;
  /** 0 is greedy; default 1. */
  temperature?: number;
  top_p?: number;
  /** wisp's (and llama.cpp's): 0 is off. */
  top_k?: number;
  min_p?: number;
  repeat_penalty?: number;
  /** The same seed, the same text. */
  seed?: number;
  /** Up to 4 sequences; the text ends before the first. */
  stop?: string | string[];
  response_format?: ResponseFormat;
  /** llama.cpp's names for the same constraints. */
  json_schema?: object | boolean;
  regex?: string;
  grammar?: string;
  n?: 1;
  presence_penalty?: 0;
  frequency_penalty?: 0;
}

export interface ChatCompletionParams extends CommonParams {
  messages: ChatMessage[];
}

export interface CompletionParams extends CommonParams {
  prompt: string;
}

export interface Streaming {
  stream: true;
  stream_options?: { include_usage?: boolean };
}

export interface NotStreaming {
  stream?: false | null;
}

export interface RequestOptions {
  /** Aborting it stops the generation; the call or the stream throws an `AbortError`. */
  signal?: AbortSignal;
}

/** `stop` (the end of the turn or a stop sequence), `length`, or `constraint` (the constraint admitted no token). */
export type FinishReason = 'stop' | 'length' | 'constraint';

export interface Usage {
  prompt_tokens: number;
  completion_tokens: number;
  total_tokens: number;
}

/** The engine's figures of one completion. */
export interface WispFigures {
  prefill_tokens: number;
  prefill_ms: number;
  prefill_tokens_per_s: number | null;
  decode_tokens: number;
  decode_ms: number;
  decode_tokens_per_s: number | null;
  cpu_matmuls: number;
  cpu_gflop: number;
  gpu_calls: number;
  gpu_gflop: number;
  gpu_ms: number;
  gpu_fallbacks: number;
}

interface Head {
  id: string;
  created: number;
  model: string;
}

export interface ChatCompletion extends Head {
  object: 'chat.completion';
  choices: Array<{ index: 0; message: { role: 'assistant'; content: string }; logprobs: null; finish_reason: FinishReason }>;
  usage: Usage;
  wisp: WispFigures;
}

export interface ChatCompletionChunk extends Head {
  object: 'chat.completion.chunk';
  /** Empty in the usage chunk (`stream_options.include_usage`). */
  choices: Array<{ index: 0; delta: { role?: 'assistant'; content?: string }; logprobs: null; finish_reason: FinishReason | null }>;
  usage?: Usage;
  /** On the chunk with the finish reason, and the usage chunk. */
  wisp?: WispFigures;
}

export interface Completion extends Head {
  object: 'text_completion';
  choices: Array<{ index: 0; text: string; logprobs: null; finish_reason: FinishReason | null }>;
  usage?: Usage;
  wisp?: WispFigures;
}

export interface EmbeddingParams {
  /** A text, texts, token ids or lists of token ids: 1 to 2048 inputs, none empty, each within `contextSize` tokens. */
  input: string | string[] | number[] | number[][];
  /** `float` (the default): arrays of numbers; `base64`: the base64 of each vector's little-endian f32 values. */
  encoding_format?: 'float' | 'base64';
}

/** The inputs' vectors, in order: the model's hidden states after its last norm, pooled and L2-normalized. */
export interface Embeddings {
  object: 'list';
  data: Array<{ object: 'embedding'; index: number; embedding: number[] | string }>;
  model: string;
  usage: { prompt_tokens: number; total_tokens: number };
}

/** The chunks of a streamed completion. Leaving the loop early stops the generation. */
export interface Stream<T> extends AsyncIterable<T> {
  controller: { abort(): void };
  /** Reads the stream to its end and returns its text. */
  text(): Promise<string>;
}

export interface Engine {
  readonly env: EngineEnv;
  readonly model: LoadedModel;
  readonly chat: {
    completions: {
      create(body: ChatCompletionParams & Streaming, options?: RequestOptions): Promise<Stream<ChatCompletionChunk>>;
      create(body: ChatCompletionParams & NotStreaming, options?: RequestOptions): Promise<ChatCompletion & { usage: Usage; wisp: WispFigures }>;
    };
  };
  readonly completions: {
    create(body: CompletionParams & Streaming, options?: RequestOptions): Promise<Stream<Completion>>;
    create(body: CompletionParams & NotStreaming, options?: RequestOptions): Promise<Completion & { usage: Usage; wisp: WispFigures }>;
  };
  readonly embeddings: {
    create(body: EmbeddingParams): Promise<Embeddings>;
  };
  /** Stops the worker; pending completions fail with code `unloaded`. */
  unload(): void;
}

/** Starts a worker with the engine and loads the model into it (from the cache when it is there). */
export function createEngine(options: EngineOptions): Promise<Engine>;

export interface CachedModel {
  sha256: string;
  name: string;
  url: string | null;
  bytes: number;
  cachedAt: string | null;
}

/** The models in this origin's cache, oldest first. */
export function listCachedModels(): Promise<CachedModel[]>;
/** Deletes a cached model (and the URLs that named it); resolves to whether there was one. */
export function deleteCachedModel(sha256: string): Promise<boolean>;

/**
 * An engine error. `code`: `invalid_request_error` and `context_length_exceeded` for requests
 * (`param` names the field), the guest's tags (`invalid-constraint`, `invalid-model`, ...),
 * `model_mismatch`, `model_not_found`, `worker_failed`, `unloaded`.
 */
export class WispError extends Error {
  readonly code: string;
  readonly param: string | null;
  readonly type: 'invalid_request_error' | 'engine_error';
}
