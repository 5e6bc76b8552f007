// Stacked weights (kquant_blocks.h): one linear whose row ranges are stored in different
// block kinds, run as one call. Why: llama.cpp's mixes store a layer's attn_v (and some
// ffn_down) in more bits than attn_q / attn_k, so a fused q/k/v has parts of two or three
// kinds; as one weight the fused decode step takes it like any other linear. Each part runs
// its own kind's kernel (linear_range_rows) on the output columns of its rows; activations
// are prepared once per distinct part kind, in regions of ``rows`` rows each.

#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>

#include "kquant_blocks.h"
#include "linear.h"

namespace llmrt_kernels {

namespace {

struct Part {
  int64_t kind, rows, row_bytes, offset;
};

int parts_of(int64_t kind, int64_t* kinds) {
  int count = 0;
  for (int i = 0; i < kStackedMaxParts; ++i) {
    const int64_t part = stacked_part_kind(kind, i);
    if (part == 0) break;
    kinds[count++] = part;
  }
  return count;
}

// Byte offset (per row of ``rows``) of the prepared region of part kind ``part``: the sum of
// the distinct kinds before its first occurrence.
int64_t region_of(int64_t kind, int64_t part, int64_t k) {
  int64_t kinds[kStackedMaxParts];
  const int count = parts_of(kind, kinds);
  int64_t offset = 0;
  for (int i = 0; i < count; ++i) {
    bool seen = false;
    for (int j = 0; j < i; ++j) seen = seen || kinds[j] == kinds[i];
    if (seen) continue;
    if (kinds[i] == part) return offset;
    offset += linear_prep_bytes(kinds[i], k);
  }
  return offset;
}

int read_parts(const uint8_t* blob, Part* parts) {
  int64_t head[2];
  std::memcpy(head, blob, sizeof(head));
  const int count = static_cast<int>(head[1]);
  std::memcpy(parts, blob + sizeof(head), sizeof(Part) * static_cast<size_t>(count));
  return count;
}

}  // namespace

int64_t stacked_prep_bytes(int64_t kind, int64_t k) {
  int64_t kinds[kStackedMaxParts];
  const int count = parts_of(kind, kinds);
  int64_t total = 0;
  for (int i = 0; i < count; ++i) {
    bool seen = false;
    for (int j = 0; j < i; ++j) seen = seen || kinds[j] == kinds[i];
    if (!seen) total += linear_prep_bytes(kinds[i], k);
  }
  return total;
}

void stacked_prepare(const float* x, int64_t r0, int64_t r1, int64_t rows, int64_t kind,
                     int64_t k, uint8_t* prep) {
  int64_t kinds[kStackedMaxParts];
  const int count = parts_of(kind, kinds);
  for (int i = 0; i < count; ++i) {
    bool seen = false;
    for (int j = 0; j < i; ++j) seen = seen || kinds[j] == kinds[i];
    if (!seen)
      linear_prepare(x, r0, r1, rows, kinds[i], k, prep + rows * region_of(kind, kinds[i], k));
  }
}

void stacked_range(const float* x, int64_t rows_m, const uint8_t* blob, int64_t n, int64_t kind,
                   int64_t k, const uint8_t* prep, float* y, int64_t n0, int64_t n1) {
  Part parts[kStackedMaxParts];
  const int count = read_parts(blob, parts);
  int64_t start = 0;
  for (int i = 0; i < count; ++i) {
    const Part& p = parts[i];
    const int64_t a = n0 > start ? n0 : start, b = n1 < start + p.rows ? n1 : start + p.rows;
    if (a < b) {
      // Row ``start`` of the whole weight is the part's first row: the part's rows read as
      // rows [start, start + rows) of an n-row weight, so y keeps its layout.
      const uint8_t* base = blob + p.offset - start * p.row_bytes;
      const uint8_t* part_prep =
          prep == nullptr ? nullptr : prep + rows_m * region_of(kind, p.kind, k);
      linear_range_rows(x, rows_m, base, n, p.row_bytes, p.kind, k, part_prep, y, a, b);
    }
    start += p.rows;
  }
}

void stacked_dequantize(const uint8_t* blob, int64_t kind, int64_t k, float* out) {
  (void)kind;
  Part parts[kStackedMaxParts];
  const int count = read_parts(blob, parts);
  int64_t start = 0;
  for (int i = 0; i < count; ++i) {
    const Part& p = parts[i];
    dequantize_rows(blob + p.offset, p.row_bytes, p.kind, k, out + start * k, p.rows);
    start += p.rows;
  }
}

void stacked_check(const at::Tensor& blob, int64_t kind, int64_t k) {
  const int64_t bytes = blob.numel();
  TORCH_CHECK(bytes >= 16, "llmrt_kernels: a stacked weight needs its header");
  const uint8_t* data = blob.const_data_ptr<uint8_t>();
  int64_t head[2];
  std::memcpy(head, data, sizeof(head));
  int64_t kinds[kStackedMaxParts];
  const int count = parts_of(kind, kinds);
  TORCH_CHECK(head[0] == kStackedMagic && head[1] == count && count >= 2,
              "llmrt_kernels: stacked weight header does not match its kind code ", kind);
  Part parts[kStackedMaxParts];
  read_parts(data, parts);
  int64_t rows = 0;
  for (int i = 0; i < count; ++i) {
    const Part& p = parts[i];
    TORCH_CHECK(p.kind == kinds[i] && p.kind != 0 && !is_stacked_kind(p.kind),
                "llmrt_kernels: stacked part ", i, " has kind ", p.kind, ", the code says ",
                kinds[i]);
    TORCH_CHECK(p.rows > 0 && p.row_bytes > 0 && p.offset >= 16 + 32 * count &&
                    p.offset <= bytes && p.rows * p.row_bytes <= bytes - p.offset,
                "llmrt_kernels: stacked part ", i, " lies outside the blob");
    // The part's own rows must be a valid weight of its kind (check_weight's rules).
    const at::Tensor view = blob.view({-1}).narrow(0, p.offset, p.rows * p.row_bytes)
                                .view({p.rows, p.row_bytes});
    check_weight(view, p.kind, k);
    rows += p.rows;
  }
  TORCH_CHECK(rows == blob.size(0), "llmrt_kernels: stacked parts hold ", rows,
              " rows, the weight ", blob.size(0));
}

}  // namespace llmrt_kernels
