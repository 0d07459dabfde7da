// Plan: the index sorted by destination row (CSR), source ids inside a row in increasing order,
// which fixes the summation order for every thread count. Two sorts, picked by cost (policy.h):
//   count  histogram of the N rows, prefix sum, stable placement: O(N + K)
//   radix  LSD radix sort of packed (row << 32 | source) keys on the row bits: O(K) per digit
//          (8-11 bits), independent of N; stable, so sources stay in increasing order
// The index is validated first (nothing of the plan is usable if that throws).
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "big_alloc.h"
#include "policy.h"
#include "scatter_add/scatter_add.h"
#include "strategy.h"
#include "validate.h"

namespace scatter_add {
namespace {

using cpu::CpuPolicy;

template <class I, class F>
void for_each_kept(const I* idx, int64_t k, std::optional<int64_t> ignore, F&& f) {
  if (ignore) {
    const int64_t ign = *ignore;
    for (int64_t i = 0; i < k; ++i) {
      const int64_t v = static_cast<int64_t>(idx[i]);
      if (v != ign) f(i, v);
    }
  } else {
    for (int64_t i = 0; i < k; ++i) f(i, static_cast<int64_t>(idx[i]));
  }
}

template <class F>
void visit_index(const IndexVector& index, std::optional<int64_t> ignore, F&& f) {
  if (index.type == IndexType::i32)
    for_each_kept(static_cast<const int32_t*>(index.data), index.size, ignore, f);
  else
    for_each_kept(static_cast<const int64_t*>(index.data), index.size, ignore, f);
}

// 32-bit counts kept in the plan's 64-bit scratch: a type that may alias it.
typedef uint32_t __attribute__((may_alias)) Count32;

int bits_for(int64_t n) {  // bits needed for values in [0, n)
  int b = 0;
  while (b < 63 && (int64_t(1) << b) < n) ++b;
  return b;
}
}  // namespace


Plan Plan::build(const IndexVector& index, int64_t num_rows, std::optional<int64_t> ignore_index,
                 Strategy method) {
  Plan p;
  p.rebuild(index, num_rows, ignore_index, method);
  return p;
}

size_t Plan::capacity_bytes() const {
  return (rows_.capacity() + offsets_.capacity() + sources_.capacity() + ignored_.capacity() + scratch_.capacity()) *
         sizeof(int64_t);
}

void Plan::rebuild(const IndexVector& index, int64_t num_rows, std::optional<int64_t> ignore_index,
                   Strategy method) {
  if (num_rows < 0)
    throw Error(Error::Kind::value, "num_rows must be >= 0, got " + std::to_string(num_rows));
  if (index.size < 0)
    throw Error(Error::Kind::value, "index size must be >= 0, got " + std::to_string(index.size));
  if (index.size > 0 && index.data == nullptr)
    throw Error(Error::Kind::value,
                "index is null but has " + std::to_string(index.size) + " entries");
  if (index.type != IndexType::i32 && index.type != IndexType::i64)
    throw Error(Error::Kind::value,
                "index type must be int32 or int64, got code " +
                    std::to_string(static_cast<int>(index.type)));
  if (method != Strategy::automatic && method != Strategy::count && method != Strategy::radix)
    throw Error(Error::Kind::value, "a plan is built by count or radix (or automatic), got method code " +
                                        std::to_string(static_cast<int>(method)));
  rows_.clear();
  offsets_.clear();
  sources_.clear();
  ignored_.clear();
  num_rows_ = 0;
  num_entries_ = 0;
  ignore_index_.reset();

  const int64_t k = index.size;
  const cpu::IndexScan scan = cpu::scan_index(index, num_rows, ignore_index);
  const int64_t kept = scan.kept;
  if (kept < k) {
    ignored_.reserve(static_cast<size_t>(k - kept));
    const int64_t ign = *ignore_index;
    auto collect = [&](const auto* idx) {
      for (int64_t i = 0; i < k; ++i)
        if (static_cast<int64_t>(idx[i]) == ign) ignored_.push_back(i);
    };
    if (index.type == IndexType::i32)
      collect(static_cast<const int32_t*>(index.data));
    else
      collect(static_cast<const int64_t*>(index.data));
  }
  const bool fits32 = num_rows <= (int64_t(1) << 32) && k <= (int64_t(1) << 32);
  // A forced count keeps its O(num_rows) histogram only while that is not far larger than the
  // index: the plan (and every result) is the same either way, the histogram of a huge num_rows
  // would not fit in memory.
  const bool count_fits = num_rows <= std::max<int64_t>(int64_t(1) << 26, 64 * std::max<int64_t>(kept, 1));
  bool radix = method == Strategy::radix || (method == Strategy::count && !count_fits) ||
               (method != Strategy::count && cpu::plan_prefers_radix(num_rows, kept));
  cpu::reserve_huge(sources_, static_cast<size_t>(kept));
  sources_.resize(static_cast<size_t>(kept));

  if (radix && fits32) {
    // Packed keys (row << 32 | source), sorted on the row bits only: stable, so equal rows keep
    // their sources in increasing order.
    cpu::reserve_huge(scratch_, 2 * static_cast<size_t>(kept));
    scratch_.resize(2 * static_cast<size_t>(kept));
    uint64_t* a = reinterpret_cast<uint64_t*>(scratch_.data());
    uint64_t* b = a + kept;
    int64_t j = 0;
    visit_index(index, ignore_index, [&](int64_t i, int64_t v) {
      a[j++] = (static_cast<uint64_t>(v) << 32) | static_cast<uint64_t>(i);
    });
    const int bits = bits_for(num_rows);
    const int passes = (bits + CpuPolicy::kRadixDigitBits - 1) / CpuPolicy::kRadixDigitBits;
    const int digit = passes > 0 ? (bits + passes - 1) / passes : 0;
    std::vector<int64_t> hist(static_cast<size_t>(1) << digit);
    for (int p = 0; p < passes && kept > 0; ++p) {
      const int shift = 32 + p * digit;
      const uint64_t mask = (uint64_t(1) << digit) - 1;
      std::fill(hist.begin(), hist.end(), 0);
      for (int64_t i = 0; i < kept; ++i) ++hist[(a[i] >> shift) & mask];
      if (hist[(a[0] >> shift) & mask] == kept) continue;  // one digit value: already in order
      int64_t pos = 0;
      for (auto& h : hist) {
        const int64_t c = h;
        h = pos;
        pos += c;
      }
      for (int64_t i = 0; i < kept; ++i) b[hist[(a[i] >> shift) & mask]++] = a[i];
      std::swap(a, b);
    }
    // The rows' starts, with no branch per entry (as the counting sort below).
    const size_t most = static_cast<size_t>(std::min<int64_t>(num_rows, kept));
    cpu::reserve_huge(rows_, most + 1);
    cpu::reserve_huge(offsets_, most + 2);
    rows_.resize(most + 1);
    offsets_.resize(most + 2);
    int64_t* rows = rows_.data();
    int64_t* offs = offsets_.data();
    int64_t* srcs = sources_.data();
    int64_t r = 0, prev = -1;
    for (int64_t i = 0; i < kept; ++i) {
      const int64_t row = static_cast<int64_t>(a[i] >> 32);
      rows[r] = row;
      offs[r] = i;
      r += row != prev;
      prev = row;
      srcs[i] = static_cast<int64_t>(a[i] & 0xFFFFFFFFu);
    }
    offs[r] = kept;
    rows_.resize(static_cast<size_t>(r));
    offsets_.resize(static_cast<size_t>(r) + 1);
  } else if (radix) {
    // Beyond 32-bit rows or sources (rare): a comparison sort of (row, source) pairs.
    std::vector<std::pair<int64_t, int64_t>> pairs;
    pairs.reserve(static_cast<size_t>(kept));
    visit_index(index, ignore_index, [&](int64_t i, int64_t v) { pairs.emplace_back(v, i); });
    std::sort(pairs.begin(), pairs.end());
    for (size_t j = 0; j < pairs.size(); ++j) {
      if (j == 0 || pairs[j].first != pairs[j - 1].first) {
        rows_.push_back(pairs[j].first);
        offsets_.push_back(static_cast<int64_t>(j));
      }
      sources_[j] = pairs[j].second;
    }
    offsets_.push_back(kept);
  } else {
    // Counting sort: histogram, prefix sum over touched rows (counts become write cursors),
    // stable placement in source order. The counts are 32-bit where the index allows (half the
    // footprint that the histogram and the placement hit at random), and the touched rows are
    // collected with no branch per row (a random mix of empty and touched rows mispredicts).
    auto count_sort = [&](auto* counts) {
      using C = std::remove_pointer_t<decltype(counts)>;
      visit_index(index, ignore_index, [&](int64_t, int64_t v) { ++counts[v]; });
      const size_t most = static_cast<size_t>(std::min<int64_t>(num_rows, kept));
      cpu::reserve_huge(rows_, most + 1);
      cpu::reserve_huge(offsets_, most + 2);
      rows_.resize(most + 1);  // the write past the last touched row lands in bounds
      offsets_.resize(most + 2);
      int64_t* rows = rows_.data();
      int64_t* offs = offsets_.data();
      int64_t pos = 0, j = 0;
      for (int64_t r = 0; r < num_rows; ++r) {
        const int64_t c = static_cast<int64_t>(counts[r]);
        rows[j] = r;
        offs[j] = pos;
        counts[r] = static_cast<C>(pos);
        pos += c;
        j += c != 0;
      }
      offs[j] = pos;
      rows_.resize(static_cast<size_t>(j));
      offsets_.resize(static_cast<size_t>(j) + 1);
      int64_t* srcs = sources_.data();
      visit_index(index, ignore_index, [&](int64_t i, int64_t v) { srcs[counts[v]++] = i; });
    };
    if (kept < (int64_t(1) << 31)) {
      cpu::reserve_huge(scratch_, static_cast<size_t>(num_rows + 1) / 2);
      scratch_.assign(static_cast<size_t>(num_rows + 1) / 2, 0);
      count_sort(reinterpret_cast<Count32*>(scratch_.data()));
    } else {
      cpu::reserve_huge(scratch_, static_cast<size_t>(num_rows));
      scratch_.assign(static_cast<size_t>(num_rows), 0);
      count_sort(scratch_.data());
    }
  }
  num_rows_ = num_rows;
  num_entries_ = k;
  ignore_index_ = ignore_index;
}

}  // namespace scatter_add
