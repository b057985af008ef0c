use super::*;

const U: u64 = UNIT;
const S: Stream = Stream::sim(7);
const DIRTY: OwnerId = OwnerId(1);

fn clean() -> State {
    State::Free {
        owner: OwnerId::CLEAN,
        seq: 0,
    }
}

/// A run of one clean free large block `[0, units * U)`, and an arena with one stream owner.
fn arena(units: u64) -> (Arena, u32) {
    let mut a = Arena::new();
    a.add_owner();
    let b = a.new_run(0, units * U, Pool::Large, clean());
    (a, b)
}

/// The run containing block `i`, as (addr, size, state) from its head.
fn run(a: &Arena, mut i: u32) -> Vec<(u64, u64, State)> {
    while a.blocks[i as usize].prev != NIL {
        i = a.blocks[i as usize].prev;
    }
    let mut out = Vec::new();
    loop {
        let b = &a.blocks[i as usize];
        out.push((b.addr / U, b.size / U, b.state));
        if b.next == NIL {
            return out;
        }
        i = b.next;
    }
}

fn free(a: &mut Arena, i: u32, owner: OwnerId, seq: u64) {
    let addr = a.blocks[i as usize].addr;
    a.live.remove(&addr);
    a.blocks[i as usize].state = State::Free { owner, seq };
    a.coalesce_insert(i);
}

fn live(requested: u64) -> State {
    State::Live {
        requested,
        stream: S,
    }
}

#[test]
fn take_splits_and_free_merges_back() {
    let (mut a, b) = arena(8);
    let addr = a.take(b, 2 * U, 2 * U - 3, S, |_, _| 0);
    assert_eq!(addr, 0);
    let i = a.live[&0];
    assert_eq!(run(&a, i), vec![(0, 2, live(2 * U - 3)), (2, 6, clean())]);
    a.validate().unwrap();
    free(&mut a, i, OwnerId::CLEAN, 0);
    assert_eq!(run(&a, i), vec![(0, 8, clean())]);
    let t = a.validate().unwrap();
    assert_eq!((t.live_count, t.block_bytes), (0, 8 * U));
    assert_eq!(a.bins[0][Pool::Large as usize].count, 1);
}

#[test]
fn take_at_an_offset_leaves_the_front_free() {
    let (mut a, b) = arena(8);
    let addr = a.take(b, 2 * U, 2 * U, S, |start, size| {
        assert_eq!((start, size), (0, 8 * U));
        3 * U
    });
    assert_eq!(addr, 3 * U);
    assert_eq!(
        run(&a, a.live[&addr]),
        vec![(0, 3, clean()), (3, 2, live(2 * U)), (5, 3, clean())]
    );
    a.validate().unwrap();
}

#[test]
fn placement_is_asked_for_large_blocks_with_room_only() {
    let mut a = Arena::new();
    let b = a.new_run(0, 8 * U, Pool::Medium, clean());
    a.take(b, 2 * U, 2 * U, S, |_, _| {
        panic!("paged pools take the start")
    });
    let (mut a, b) = arena(2);
    a.take(b, 2 * U, 2 * U, S, |_, _| {
        panic!("an exact fit needs no placement")
    });
}

#[test]
fn dirty_absorbs_clean_but_clean_does_not_absorb_dirty() {
    let (mut a, b) = arena(8);
    a.take(b, 2 * U, 2 * U, S, |_, _| 0);
    let rest = a.find(U, Pool::Large, None).unwrap();
    a.take(rest, 2 * U, 2 * U, S, |_, _| 0);
    let (x, y) = (a.live[&0], a.live[&(2 * U)]);
    // x freed dirty: its neighbour y is live, nothing to merge.
    free(&mut a, x, DIRTY, 5);
    // y freed clean: merges with the clean rest, not with dirty x.
    free(&mut a, y, OwnerId::CLEAN, 0);
    let dirty5 = State::Free {
        owner: DIRTY,
        seq: 5,
    };
    assert_eq!(run(&a, x), vec![(0, 2, dirty5), (2, 6, clean())]);
    a.validate().unwrap();
    // Cleaning x (its fence covers seq 5) merges the whole run into one clean block.
    a.make_clean(DIRTY, 4);
    assert_eq!(run(&a, x).len(), 2, "seq 5 is not covered by 4");
    a.make_clean(DIRTY, 5);
    assert_eq!(run(&a, x), vec![(0, 8, clean())]);
    a.validate().unwrap();
}

#[test]
fn a_dirty_free_takes_its_clean_neighbours_and_the_highest_seq() {
    let (mut a, b) = arena(8);
    a.take(b, 2 * U, 2 * U, S, |_, _| 0);
    let rest = a.find(U, Pool::Large, None).unwrap();
    a.take(rest, 2 * U, 2 * U, S, |_, _| 0);
    let (x, y) = (a.live[&0], a.live[&(2 * U)]);
    free(&mut a, x, DIRTY, 3);
    free(&mut a, y, DIRTY, 9);
    let dirty9 = State::Free {
        owner: DIRTY,
        seq: 9,
    };
    assert_eq!(run(&a, x), vec![(0, 8, dirty9)]);
    assert_eq!(a.bins[1][Pool::Large as usize].count, 1);
    assert_eq!(a.bins[0][Pool::Large as usize].count, 0);
    a.validate().unwrap();
}

#[test]
fn carve_cuts_a_standalone_block_and_ends_the_pieces_runs() {
    let (mut a, b) = arena(8);
    let m = a.carve(b, 2 * U, 3 * U);
    let x = &a.blocks[m as usize];
    assert_eq!((x.addr, x.size, x.prev, x.next), (2 * U, 3 * U, NIL, NIL));
    assert_eq!(run(&a, b), vec![(0, 2, clean())], "b keeps the piece below");
    let above = a.find(3 * U, Pool::Large, None).unwrap();
    assert_eq!(run(&a, above), vec![(5, 3, clean())]);
    assert!(
        a.validate().is_err(),
        "the carved block is free but in no list"
    );
    a.list(m);
    a.validate().unwrap();
    // At the start of a block, the block itself becomes the carved one.
    let (mut a, b) = arena(4);
    assert_eq!(a.carve(b, 0, 4 * U), b);
    assert_eq!(a.bins[0][Pool::Large as usize].count, 0);
}

#[test]
fn find_prefers_the_own_stream_on_a_tie_and_the_smaller_block() {
    let mut a = Arena::new();
    a.add_owner();
    let c = a.new_run(0, 4 * U, Pool::Large, clean());
    let d = a.new_run(
        64 * U,
        4 * U,
        Pool::Large,
        State::Free {
            owner: DIRTY,
            seq: 1,
        },
    );
    assert_eq!(a.find(4 * U, Pool::Large, Some(DIRTY)), Some(d));
    assert_eq!(a.find(4 * U, Pool::Large, None), Some(c));
    let big = a.new_run(128 * U, 64 * U, Pool::Large, clean());
    assert_eq!(
        a.find_exhaustive(8 * U, Pool::Large, Some(DIRTY)),
        Some(big)
    );
    assert_eq!(a.find(U, Pool::Small, None), None);
    a.validate().unwrap();
}

#[test]
fn append_run_grows_a_free_tail_into_one_block() {
    let (mut a, b) = arena(4);
    let j = a.append_run(b, 4 * U, clean());
    assert_eq!(j, b, "the tail absorbs the new memory");
    assert_eq!(run(&a, b), vec![(0, 8, clean())]);
    assert_eq!(a.bins[0][Pool::Large as usize].bytes, 8 * U);
    a.validate().unwrap();
}

#[test]
fn append_run_links_new_memory_after_a_live_block_and_merges_when_it_is_freed() {
    let (mut a, b) = arena(4);
    a.take(b, 4 * U, 4 * U, S, |_, _| 0);
    let j = a.append_run(b, 4 * U, clean());
    assert_ne!(j, b);
    assert_eq!(run(&a, b), vec![(0, 4, live(4 * U)), (4, 4, clean())]);
    a.validate().unwrap();
    // Freed, the old block and the appended memory are one free block across the join.
    free(&mut a, b, OwnerId::CLEAN, 0);
    assert_eq!(run(&a, b), vec![(0, 8, clean())]);
    a.validate().unwrap();
}

#[test]
fn append_run_of_dirty_memory_absorbs_a_clean_tail_but_clean_memory_keeps_a_dirty_one() {
    let dirty = State::Free {
        owner: DIRTY,
        seq: 3,
    };
    let (mut a, b) = arena(4);
    a.append_run(b, 2 * U, dirty);
    assert_eq!(run(&a, b), vec![(0, 6, dirty)]);
    a.validate().unwrap();
    let (mut a, b) = arena(4);
    a.unlist(b);
    a.blocks[b as usize].state = dirty;
    a.list(b);
    a.append_run(b, 2 * U, clean());
    assert_eq!(run(&a, b), vec![(0, 4, dirty), (4, 2, clean())]);
    a.validate().unwrap();
}

#[test]
fn validate_catches_an_unmerged_pair_and_a_stale_live_entry() {
    let (mut a, b) = arena(4);
    a.unlist(b);
    let j = a.split(b, U);
    a.list(b);
    a.list(j);
    assert!(a.validate().unwrap_err().contains("not merged"));
    let (mut a, b) = arena(4);
    a.live.insert(0, b);
    assert!(a.validate().is_err());
}
