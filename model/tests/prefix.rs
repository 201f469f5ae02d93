//! The prefix cache on the CPU backend and the transformers fixture (the checks are in
//! tests/common/prefix.rs; tests/cuda.rs runs them on the GPU).

mod common;

use common::prefix::*;
use model::cpu::Cpu;

const CPU: NewBackend<Cpu> = &Cpu::default;
/// The CPU's scan is token by token whatever the split: the same logits, no flip but at an
/// exact tie.
const EXACT: Case<Cpu> = Case { backend: CPU, tie: 0.0, router_tie: 0.0 };

/// The CPU's split prefill stores the SSM state in f32 midway, its whole prefill carries it in
/// f64 (tests/model_cpu.rs): within 1e-2.
#[test]
fn cpu_restored_state_continues_as_the_saved_slot_would() {
    restored_state_continues_as_the_saved_slot_would(CPU, 1e-2);
}

/// The router near-tie check the CUDA comparisons use, on the CPU: it takes the flip the
/// reference explains and nothing near it.
#[test]
fn router_near_ties_are_checked() {
    router_near_ties_are_checked_against_the_reference(Case { backend: CPU, tie: 0.05, router_tie: 2e-3 });
}

#[test]
fn cpu_conversations_restore_each_turn() {
    conversations_restore_each_turn(EXACT);
}

#[test]
fn cpu_shared_system_prompt_is_restored_whatever_follows() {
    shared_system_prompt_is_restored_whatever_follows(EXACT);
}

#[test]
fn cpu_hits_that_end_where_a_snapshot_does() {
    hits_that_end_where_a_snapshot_does(EXACT);
}

#[test]
fn cpu_evicted_snapshot_falls_back_to_prefill() {
    evicted_snapshot_falls_back_to_prefill(EXACT);
}

#[test]
fn cpu_two_requests_share_a_snapshot_at_once() {
    two_requests_share_a_snapshot_at_once(EXACT);
}

#[test]
fn cpu_request_cancelled_mid_prefill_leaves_no_snapshot() {
    request_cancelled_mid_prefill_leaves_no_snapshot(EXACT);
}
