"""Everything that judges a result: self-checks and their policies, the errors they raise, the
first-order certificate (docs/algorithm.md, 'Approximate answers: certificate, oversampling, refinement, verification'),
least-squares refinement ('Approximate answers: certificate, oversampling, refinement, verification') and verification
on fresh queries."""
