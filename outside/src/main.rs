//! Text in, text out through `model::text::Llm`: the README's example, as a user's crate has it.

use model::text::{Generation, Llm, LoadOptions};

fn main() -> Result<(), model::Error> {
    // A checkpoint directory or a Hugging Face repo id; none: the built-in model (random weights).
    let checkpoint = std::env::args().nth(1);
    let mut llm = Llm::load(checkpoint.as_deref(), &LoadOptions::default())?;
    let how = Generation { max_new_tokens: 16, ..Generation::default() };
    println!("completion: {:?}", llm.complete("The capital of France is", &how)?);
    let reply = llm.chat(&serde_json::json!([{"role": "user", "content": "Hello!"}]), &how)?;
    println!("reply: {:?}, reasoning: {:?}", reply.content, reply.reasoning);
    Ok(())
}
