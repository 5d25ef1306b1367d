"""The oracle boundary (docs/algorithm.md, 'The paper schedule'): counting, validation, budgets and batches
(:mod:`.boundary`), transcripts (:mod:`.transcript`), query generators (:mod:`.queries`), simulated
oracles (:mod:`.simulated`), noise wrappers (:mod:`.noise`) and an oracle spread over Ray workers
(:mod:`.parallel`)."""
