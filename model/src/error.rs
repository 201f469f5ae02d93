/// Everything the model crate can fail with. Messages say what is wrong and where.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A GPU or kernel-argument error from the host crate.
    #[error(transparent)]
    Host(#[from] host::Error),
    /// `config.json` is unreadable, incomplete, inconsistent or asks for something unsupported.
    #[error("config.json: `{field}` {reason}")]
    Config { field: String, reason: String },
    /// A checkpoint file is missing, corrupt, or lacks / mis-shapes / mistypes a tensor.
    #[error("checkpoint {}: {}{reason}", path.display(), if tensor.is_empty() { String::new() } else { format!("tensor `{tensor}` ") })]
    Checkpoint { path: std::path::PathBuf, tensor: String, reason: String },
    /// The checkpoint's tensors do not match its config: every problem, one per line.
    #[error("the checkpoint does not match its config.json ({} problems):\n  {}", .0.len(), .0.join("\n  "))]
    Tensors(Vec<String>),
    /// A limit of the engine was reached (state slots, sequence length).
    #[error("capacity: {0}")]
    Capacity(String),
    /// A request's value out of its range (a sampling parameter, an empty prompt, a token id
    /// outside the vocabulary), or an engine setting that cannot be.
    #[error("invalid: {0}")]
    Invalid(String),
    /// A request or a checkpoint feature this code does not handle (yet).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A chat template is missing, malformed, does not compile, or failed to render (its
    /// `raise_exception` refusing the request among the causes).
    #[error("chat template: {0}")]
    Template(String),
    /// What a model argument names is not there (no such directory, nor a repo id in the
    /// Hugging Face cache).
    #[error("{0}")]
    Locate(String),
    /// A checkpoint's tokenizer (or its generation settings) is missing or unreadable, or
    /// failed to encode or decode.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A request's logits gave no token (a NaN among them, or all `-inf`).
    #[error("no token: {0}")]
    NoToken(String),
    /// Writing the output failed (a closed pipe, say).
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// A model step failed (out of device memory, say); the engine ended the requests that
    /// were in it (their states may be half updated) and goes on with the others.
    #[error("a step failed, ending requests {requests:?}: {source}")]
    StepFailed { requests: Vec<u64>, source: Box<Error> },
}

/// The model crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
