// Batch-invariant mode: every kernel gives a row a result that does not depend on how many
// other rows share the call or where they sit (fixed reduction order per row, fixed split
// sizes). Process-wide, read at eval / planning time; docs/serving.md says what it covers.
#pragma once

namespace vllm_metal::cpu {

bool batch_invariant();
void set_batch_invariant(bool on);

}  // namespace vllm_metal::cpu
