// Generated from plugins/quant_formats.py's WeightFormat by `python -m ifb.plugins.quant_formats`:
// do not edit (tests/unit/test_weight_formats.py fails when it differs from the enum).
//
// X(id, name, block bytes, weights per block) for each block format, in the enum's order. The
// name is the enum's value: what engine.json records and the ifb_quant ops' `format` takes.
#pragma once

#define IFB_BLOCK_FORMATS(X) \
  X(Q4_0, "q4_0", 18, 32)    \
  X(Q4_1, "q4_1", 20, 32)    \
  X(Q8_0, "q8_0", 34, 32)    \
  X(Q5_0, "q5_0", 22, 32)    \
  X(Q5_1, "q5_1", 24, 32)    \
  X(Q4_K, "q4_k", 144, 256)  \
  X(Q5_K, "q5_k", 176, 256)  \
  X(Q6_K, "q6_k", 210, 256)  \
  X(MXFP4, "mxfp4", 17, 32)
