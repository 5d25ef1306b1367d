"""Everything that judges a result: self-checks and their policies, the errors they raise, the
first-order certificate (§12), least-squares refinement (§12) and verification on fresh queries."""
