//! Slot allocation, and the decode/prefill split taken from request metadata.

use model::cache::{Part, SlotPool, StepPlan};

#[test]
fn slots_are_handed_out_and_taken_back() {
    let mut pool = SlotPool::new(3);
    let (a, b, c) = (pool.alloc().unwrap(), pool.alloc().unwrap(), pool.alloc().unwrap());
    assert_eq!((a, b, c), (0, 1, 2));
    assert!(pool.alloc().unwrap_err().to_string().contains("all 3 state slots are in use"));
    pool.free(1).unwrap();
    assert_eq!(pool.in_use(), 2);
    assert_eq!(pool.alloc().unwrap(), 1);
    for bad in [5, -1] {
        assert!(pool.free(bad).unwrap_err().to_string().contains("is not in use"));
    }
    pool.free(0).unwrap();
    assert!(pool.free(0).is_err(), "double free");
}

#[test]
fn decode_rows_come_from_metadata_not_token_counts() {
    let parts = [
        Part { slot: 4, computed: 0, tokens: &[7] }, // fresh one-token request: prefill
        Part { slot: 2, computed: 10, tokens: &[9] }, // continuing, one token: decode
        Part { slot: 0, computed: 5, tokens: &[1, 2, 3] }, // continuing with several: prefill with state
        Part { slot: 1, computed: 3, tokens: &[8] }, // decode
    ];
    let plan = StepPlan::new(&parts).unwrap();
    assert_eq!(plan.decode_slots, vec![2, 1]);
    assert_eq!(plan.decode_tokens, vec![9, 8]);
    assert_eq!(plan.prefill_lens, vec![1, 3]);
    assert_eq!(plan.prefill_slots, vec![4, 0]);
    assert_eq!(plan.prefill_initial, vec![false, true]);
    assert_eq!(plan.prefill_tokens, vec![7, 1, 2, 3]);
    assert_eq!(plan.order, vec![1, 3, 0, 2]);
    assert_eq!(plan.rows(), 6);
    assert!(StepPlan::new(&[Part { slot: 0, computed: 0, tokens: &[] }]).is_err());
}
