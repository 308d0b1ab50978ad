//! PostgreSQL claim-by-delete (`claim_batch` holding its transaction across the publish,
//! `settle`, the relay's concurrent `drain_woken`): concurrency and fault tests against the
//! real server. Each test says whether it is expected to FAIL (it demonstrates a bug) or to
//! PASS (a regression test).
//!
//! The tests sit in `claim/`: the recording publisher and relay helpers (`recorder.rs`),
//! the multi-relay stress runs (`stress.rs`), the claim races (`races.rs`), backlogs in
//! tables believed empty and vacuums (`backlog.rs`), and migration 0005 (`migration.rs`).

#[path = "claim/backlog.rs"]
mod backlog;
#[path = "claim/migration.rs"]
mod migration;
#[path = "claim/races.rs"]
mod races;
#[path = "claim/recorder.rs"]
mod recorder;
#[path = "claim/stress.rs"]
mod stress;

use backlog::{
    claim_backlog_in_an_outbox_believed_empty_locks_only_the_batches_in_flight,
    claim_relay_vacuums_the_outbox_every_vacuum_after_rows,
    claims_and_sweeps_on_a_backlog_believed_empty_never_seq_scan,
    lease_claim_backlog_in_an_outbox_believed_empty_locks_only_its_batch,
};
use migration::migration_0005_moves_rows_published_under_the_old_schema;
use races::{
    claim_batch_late_head_waits_for_its_partitions_row_in_flight,
    claim_batch_skip_ranges_and_reinserted_failures,
    claim_copy_enqueued_while_original_is_published_does_not_wedge_the_relay,
    claim_one_drain_publishes_every_claimable_row,
    claim_one_relay_republishes_a_panicked_batch_while_busy,
    claim_partition_locks_of_another_schemas_outbox_do_not_block,
    lease_claim_late_head_waits_for_its_partitions_leased_row,
};
use stress::{
    claim_relays_whose_publishes_panic_lose_nothing,
    claim_relays_with_flaky_publishes_lose_nothing_and_keep_order,
    claim_relays_with_late_commits_keep_one_event_per_partition_in_flight,
};

oncely_testkit::matrix! {
    tests: [
        claim_relays_with_flaky_publishes_lose_nothing_and_keep_order,
        claim_relays_whose_publishes_panic_lose_nothing,
        claim_relays_with_late_commits_keep_one_event_per_partition_in_flight,
        claim_batch_late_head_waits_for_its_partitions_row_in_flight,
        lease_claim_late_head_waits_for_its_partitions_leased_row,
        claim_copy_enqueued_while_original_is_published_does_not_wedge_the_relay,
        claim_one_drain_publishes_every_claimable_row,
        migration_0005_moves_rows_published_under_the_old_schema,
        claim_batch_skip_ranges_and_reinserted_failures,
        claim_one_relay_republishes_a_panicked_batch_while_busy,
        claim_relay_vacuums_the_outbox_every_vacuum_after_rows,
        claim_partition_locks_of_another_schemas_outbox_do_not_block,
        claim_backlog_in_an_outbox_believed_empty_locks_only_the_batches_in_flight,
        lease_claim_backlog_in_an_outbox_believed_empty_locks_only_its_batch,
        claims_and_sweeps_on_a_backlog_believed_empty_never_seq_scan,
    ],
    cannot_apply: [
        // The claim by delete (`claim_batch` holding its transaction across the
        // publish) and what these tests read (advisory locks in `pg_locks`, vacuum and
        // scan counters in `pg_stat_user_tables`) are PostgreSQL's.
        claim_relays_with_flaky_publishes_lose_nothing_and_keep_order on sqlite | mysql,
        claim_relays_whose_publishes_panic_lose_nothing on sqlite | mysql,
        claim_relays_with_late_commits_keep_one_event_per_partition_in_flight on sqlite | mysql,
        claim_batch_late_head_waits_for_its_partitions_row_in_flight on sqlite | mysql,
        lease_claim_late_head_waits_for_its_partitions_leased_row on sqlite | mysql,
        claim_copy_enqueued_while_original_is_published_does_not_wedge_the_relay on sqlite | mysql,
        claim_one_drain_publishes_every_claimable_row on sqlite | mysql,
        migration_0005_moves_rows_published_under_the_old_schema on sqlite | mysql,
        claim_batch_skip_ranges_and_reinserted_failures on sqlite | mysql,
        claim_one_relay_republishes_a_panicked_batch_while_busy on sqlite | mysql,
        claim_relay_vacuums_the_outbox_every_vacuum_after_rows on sqlite | mysql,
        claim_partition_locks_of_another_schemas_outbox_do_not_block on sqlite | mysql,
        claim_backlog_in_an_outbox_believed_empty_locks_only_the_batches_in_flight on sqlite | mysql,
        lease_claim_backlog_in_an_outbox_believed_empty_locks_only_its_batch on sqlite | mysql,
        claims_and_sweeps_on_a_backlog_believed_empty_never_seq_scan on sqlite | mysql,
    ],
}
