// Block decoders: one packed tile-block of any format -> exact fp32 weights or int8-dot operands.
//
// A packed tile-block holds one GGUF block (32 weights, or a 256-weight K-quant super-block) of
// 16 output columns, its fields transposed so one load gives all 16 columns (plugins/quant_ops.py
// documents the byte layout). The kernels step along K in 32-weight (sub-)blocks; `Block<F>(tile, b)`
// decodes the scales of 32-block b of a tile and knows where its quants lie. Both compute modes
// share the scale fields and the formulas; they differ only in the order of the quant bytes:
//   exact (pack):     `exact_pair(i)`  -> weights 2i, 2i + 1 of the block as 16 fp32 lanes
//   int8 (pack_int8): `int8_group(g)`  -> 64 bytes: per column 4 values of k = 8g..8g+3 (lo) and
//                                         8g+4..8g+7 (hi), all bits merged (unsigned, <= 63)
// Weight formulas follow gguf.quants.dequantize's fp32 roundings; where a product is exact (d fp16
// has 11 significant bits, scales 6-8, quants 4-6: at most 24) one FMA rounds as numpy's add does.
//
// MXFP4 (gpt-oss's experts): one e8m0 byte e per column and 32 4-bit e2m1 codes, w = 2^(e-128) v
// with v the code's value doubled (ggml's kvalues_mxfp4, integers |v| <= 12). Its nibbles lie as a
// legacy block's; a byte lookup (pshufb) turns each code into v + 12 (0..24, unsigned like every
// nibble format's quants), so the int8 path takes it as Q4_0 takes q (zero point 12, and the
// scale, a power of two, makes d_w d_x exact) and the exact path computes (q - 12) * 2^(e-128),
// both factors and the product exact: gguf's d * v bit for bit.
#pragma once

#include <cstdint>
#include <type_traits>

#include "quant_kernels.h"
#include "simd16.h"

namespace ifb_quant {
namespace {

template <Format F>
constexpr int64_t tile_block_bytes() {
  return block_bytes(F) * kTileColumns;
}
template <Format F>
constexpr int64_t sub_blocks() {
  return block_weights(F) / kBlockSize;
}
template <Format F>
constexpr bool is_k_quant() {
  return block_weights(F) == 256;
}
// MXFP4: code c -> its doubled e2m1 value + 12, as bytes, repeated in each 16-byte lane (lookup16).
constexpr int32_t kMxfp4Zero = 12;
alignas(64) constexpr uint8_t kMxfp4Biased[64] = {
#define IFB_MXFP4_LANE 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0
    IFB_MXFP4_LANE, IFB_MXFP4_LANE, IFB_MXFP4_LANE, IFB_MXFP4_LANE,
#undef IFB_MXFP4_LANE
};

template <Format F>
constexpr bool has_min() {  // w = q * scale + offset rather than (q - zero) * scale
  return F == Format::kQ4_1 || F == Format::kQ5_1 || F == Format::kQ4_K || F == Format::kQ5_K;
}
template <Format F>
constexpr int high_bits() {  // bits above the nibble, in a separate field
  return F == Format::kQ5_0 || F == Format::kQ5_1 || F == Format::kQ5_K ? 1 : F == Format::kQ6_K ? 2 : 0;
}
// Bytes of one tile's packed row for a K-long weight row.
template <Format F>
constexpr int64_t tile_stride(int64_t k) {
  return k / block_weights(F) * tile_block_bytes<F>();
}

template <Format F>
struct Block {
  V d;               // the block's fp16 d (MXFP4: its scale 2^(e-128))
  V scale[2];         // per 16-weight half (equal unless Q6_K): d, or d * sc for the K-quants
  V offset;           // m (Q4_1/Q5_1) or dmin * m (Q4_K/Q5_K)
  QI int_scale[2];    // Q6_K: the int8 scales of the two 16-weight halves
  V float_scale[2];   // Q6_K: the same as fp32 (exact)
  QI high[2];         // Q5: the block's 5th bits; Q6_K: its 2-bit high parts (two vectors)
  const uint8_t* quants;

  Block() = default;
  Block(const uint8_t* tile, int64_t b) {
    constexpr int64_t kSubs = sub_blocks<F>();
    const uint8_t* base = tile + (b / kSubs) * tile_block_bytes<F>();
    const int sub = static_cast<int>(b % kSubs);
    offset = zero();
    if constexpr (F == Format::kMXFP4) {
      // 2^(e-128) = 2^(h-64) 2^(h+l-64) for e = 2h + l: two normal powers of two whose product is
      // exact even where it is subnormal (e < 2, as ggml's bit patterns give it)
      const QI e = bytes_unsigned(base), h = srli(e, 1);
      d = mul(pow2(to_float(add(h, splat(-64)))), pow2(to_float(add(add(h, mask(e, 1)), splat(-64)))));
    } else {
      d = halves(base);
    }
    scale[0] = scale[1] = d;
    if constexpr (F == Format::kMXFP4) {
      quants = base + 16;
    } else if constexpr (F == Format::kQ4_0 || F == Format::kQ8_0) {
      quants = base + 32;
    } else if constexpr (F == Format::kQ4_1) {
      offset = halves(base + 32);
      quants = base + 64;
    } else if constexpr (F == Format::kQ5_0) {
      high[0] = load_bytes(base + 32);
      quants = base + 96;
    } else if constexpr (F == Format::kQ5_1) {
      offset = halves(base + 32);
      high[0] = load_bytes(base + 64);
      quants = base + 128;
    } else if constexpr (F == Format::kQ4_K || F == Format::kQ5_K) {
      // 6-bit scale and min of sub-block `sub` from the 12 scale bytes (rows of 16 columns).
      const uint8_t* s = base + 64;
      QI sc, mn;
      if (sub < 4) {
        sc = mask(bytes_unsigned(s + 16 * sub), 63);
        mn = mask(bytes_unsigned(s + 16 * (sub + 4)), 63);
      } else {
        const QI packed = bytes_unsigned(s + 16 * (sub + 4));
        sc = or_(mask(packed, 15), slli(srli(bytes_unsigned(s + 16 * (sub - 4)), 6), 4));
        mn = or_(srli(packed, 4), slli(srli(bytes_unsigned(s + 16 * sub), 6), 4));
      }
      scale[0] = scale[1] = mul(d, to_float(sc));
      offset = mul(halves(base + 32), to_float(mn));
      locate_k_quant_fields(base, sub);
    } else {
      static_assert(F == Format::kQ6_K, "Block<F>: a format of block_format_table.h without a decoder");
      for (int h = 0; h < 2; ++h) {
        int_scale[h] = bytes_signed(base + 32 + 16 * (2 * sub + h));
        float_scale[h] = to_float(int_scale[h]);
        scale[h] = mul(d, float_scale[h]);
        high[h] = load_bytes(base + 288 + 384 * sub + 64 * h);
      }
      quants = base + 288 + 384 * sub + 128;
    }
  }

  // Q4_K/Q5_K: the fields of sub-block b with its scale (d sc) and offset (dmin m) already decoded
  // (by the full constructor, for an earlier row block): kernels that run many row blocks over
  // the same tiles decode the 6-bit scales once, not once per row block.
  static Block with_scales(const uint8_t* tile, int64_t b, V decoded_scale, V decoded_offset) {
    static_assert(F == Format::kQ4_K || F == Format::kQ5_K, "with_scales: the K-quants with mins only");
    Block block;
    block.d = zero();  // unused once the scale is decoded
    block.scale[0] = block.scale[1] = decoded_scale;
    block.offset = decoded_offset;
    constexpr int64_t kSubs = sub_blocks<F>();
    block.locate_k_quant_fields(tile + (b / kSubs) * tile_block_bytes<F>(), static_cast<int>(b % kSubs));
    return block;
  }

  // Q4_K/Q5_K: where sub-block `sub` of the super-block at `base` keeps its quants (and 5th bits).
  inline void locate_k_quant_fields(const uint8_t* base, int sub) {
    if constexpr (F == Format::kQ4_K) {
      quants = base + 256 + 256 * sub;
    } else if constexpr (F == Format::kQ5_K) {  // (qh, quants) per sub-block, so a tile is read front to back
      high[0] = load_bytes(base + 256 + 320 * sub);
      quants = base + 256 + 320 * sub + 64;
    }
  }

  // Weight e of the block from its integer value q (all bits merged; int8 for Q8_0).
  inline V weight(QI q, int e) const {
    if constexpr (F == Format::kQ8_0) {
      return mul(to_float(q), scale[0]);  // numpy: x * d
    } else if constexpr (F == Format::kQ4_0 || F == Format::kQ5_0 || F == Format::kMXFP4) {
      // (q - zero) is exact and so is the product: d has 11 significant bits, q - zero at most 5
      // (MXFP4: d a power of two, v + 12 - 12 = v)
      constexpr float kZero = F == Format::kQ4_0 ? 8.0f : F == Format::kQ5_0 ? 16.0f : float{kMxfp4Zero};
      return mul(scale[0], sub(to_float(q), broadcast(kZero)));
    } else if constexpr (F == Format::kQ4_1 || F == Format::kQ5_1) {
      return fmadd(to_float(q), scale[0], offset);  // numpy rounds d * q (exact), then + m
    } else if constexpr (F == Format::kQ4_K || F == Format::kQ5_K) {
      return fmsub(to_float(q), scale[0], offset);  // (d * sc) * q is exact: one rounding, numpy's
    } else {
      return mul(scale[e / 16], sub(to_float(q), broadcast(32.0f)));  // (d * sc) * (q - 32), exact
    }
  }

  // Exact layout: weights 2i and 2i + 1 (i = 0..15).
  inline void exact_pair(int i, V& w0, V& w1) const {
    if constexpr (F == Format::kQ8_0) {
      w0 = weight(bytes_signed(quants + 32 * i), 2 * i);
      w1 = weight(bytes_signed(quants + 32 * i + 16), 2 * i + 1);
    } else {
      const QI raw = bytes_unsigned(quants + 16 * i);
      QI q0 = low_nibble(raw), q1 = high_nibble(raw);
      if constexpr (F == Format::kMXFP4) {  // (a lane's 3 upper bytes look up code 0: masked off)
        const QI table = load_bytes(kMxfp4Biased);
        q0 = mask(lookup16(table, q0), 0xFF);
        q1 = mask(lookup16(table, q1), 0xFF);
      } else if constexpr (high_bits<F>() == 1) {  // one uint32 per column, bit e = weight e's 5th bit
        q0 = merge_bits(q0, shift_bit(high[0], 2 * i, 4), splat(16));
        q1 = merge_bits(q1, shift_bit(high[0], 2 * i + 1, 4), splat(16));
      } else if constexpr (high_bits<F>() == 2) {  // two rows of uint32, bits 2e' of weight 16h + e'
        const QI& h = high[i / 8];
        q0 = merge_bits(q0, shift_bit(h, (4 * i) % 32, 4), splat(0x30));
        q1 = merge_bits(q1, shift_bit(h, (4 * i + 2) % 32, 4), splat(0x30));
      }
      w0 = weight(q0, 2 * i);
      w1 = weight(q1, 2 * i + 1);
    }
  }

  // int8 layout, nibble formats: group g = 0..3 as unsigned bytes (lo: k = 8g + b, hi: 8g + 4 + b).
  inline void int8_group(int g, QI& lo, QI& hi) const {
    const QI raw = load_bytes(quants + 64 * g);
    lo = low_nibbles(raw);
    hi = high_nibbles(raw);
    if constexpr (F == Format::kMXFP4) {  // codes -> v + 12, byte for byte
      const QI table = load_bytes(kMxfp4Biased);
      lo = lookup16(table, lo);
      hi = lookup16(table, hi);
    } else if constexpr (high_bits<F>() == 1) {  // byte b of a column: bit g = weight 8g+b, bit g+4 = 8g+4+b
      lo = merge_bits(lo, move_bits8(high[0], g, 4), splat8(0x10));
      hi = merge_bits(hi, move_bits8(high[0], g + 4, 4), splat8(0x10));
    } else if constexpr (high_bits<F>() == 2) {
      // Vector g/2, byte b: 2-bit fields of weights 8g+b (lo) and 8g+4+b (hi) at bits 4 and 6 for
      // even g, 0 and 2 for odd g, so half of them need no shift at all.
      const int at = g % 2 == 0 ? 4 : 0;
      lo = merge_bits(lo, move_bits8(high[g / 2], at, 4), splat8(0x30));
      hi = merge_bits(hi, move_bits8(high[g / 2], at + 2, 4), splat8(0x30));
    }
  }

  // int8 layout: the 16 weights of k = e as fp32 lanes (for gathers, not the matmul).
  inline V int8_weight(int e) const {
    if constexpr (F == Format::kQ8_0) {
      const QI lanes = load_bytes(quants + 64 * (e / 4));
      return weight(srai(slli(lanes, static_cast<unsigned>(24 - 8 * (e % 4))), 24), e);
    } else {
      QI lo, hi;
      int8_group(e / 8, lo, hi);
      const int b = e % 8;
      const QI lanes = b < 4 ? lo : hi;
      return weight(mask(srli(lanes, static_cast<unsigned>(8 * (b % 4))), 0xFF), e);
    }
  }
};

// Calls fn(std::integral_constant<Format, F>{}) for the runtime `format`: the one switch over formats,
// a case per entry of block_format_table.h.
template <typename Fn>
inline void with_format(Format format, Fn&& fn) {
  switch (format) {
#define IFB_FORMAT_CASE(id, name, bytes, weights)        \
  case Format::k##id:                                    \
    fn(std::integral_constant<Format, Format::k##id>{}); \
    break;
    IFB_BLOCK_FORMATS(IFB_FORMAT_CASE)
#undef IFB_FORMAT_CASE
  }
}

}  // namespace
}  // namespace ifb_quant
