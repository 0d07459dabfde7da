// Plan: counting sort of an index by destination row (CSR). One pass validates and counts, a
// prefix sum gives each touched row its slice, and a stable placement pass fills the slices in
// source order, which fixes the summation order for every thread count. For N much larger than
// K a sort of (row, source) pairs replaces the O(N) histogram.
#include <algorithm>
#include <string>
#include <utility>

#include "index_check.h"
#include "policy.h"
#include "scatter_add/scatter_add.h"

namespace scatter_add {
namespace {

template <class I>
int64_t index_at(const I* idx, int64_t i) {
  return static_cast<int64_t>(idx[i]);
}

}  // namespace

Plan Plan::build(const IndexVector& index, int64_t num_rows, std::optional<int64_t> ignore_index) {
  Plan p;
  p.rebuild(index, num_rows, ignore_index);
  return p;
}

void Plan::rebuild(const IndexVector& index, int64_t num_rows, std::optional<int64_t> ignore_index) {
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

  const int64_t k = index.size;
  const bool use_sort = num_rows > cpu::CpuPolicy::kSortRatio * k + cpu::CpuPolicy::kSortSlack;
  rows_.clear();
  offsets_.clear();
  sources_.clear();
  ignored_.clear();
  num_rows_ = 0;
  num_entries_ = 0;
  ignore_index_.reset();
  std::vector<int64_t>* counts = nullptr;
  if (!use_sort) {
    counts_.assign(static_cast<size_t>(num_rows), 0);
    counts = &counts_;
  }
  // Pass 1: validate every value (nothing of the plan is usable if this throws).
  if (index.type == IndexType::i32)
    cpu::check_index_values(static_cast<const int32_t*>(index.data), k, num_rows, ignore_index, counts,
                       &ignored_);
  else
    cpu::check_index_values(static_cast<const int64_t*>(index.data), k, num_rows, ignore_index, counts,
                       &ignored_);

  auto at = [&](int64_t i) {
    return index.type == IndexType::i32 ? index_at(static_cast<const int32_t*>(index.data), i)
                                        : index_at(static_cast<const int64_t*>(index.data), i);
  };
  const int64_t kept = k - static_cast<int64_t>(ignored_.size());
  sources_.resize(static_cast<size_t>(kept));
  if (use_sort) {
    std::vector<std::pair<int64_t, int64_t>> pairs;
    pairs.reserve(static_cast<size_t>(kept));
    for (int64_t i = 0; i < k; ++i) {
      const int64_t v = at(i);
      if (!(ignore_index && v == *ignore_index)) pairs.emplace_back(v, i);
    }
    std::sort(pairs.begin(), pairs.end());  // (row, source) pairs are distinct: order is fixed
    for (size_t j = 0; j < pairs.size(); ++j) {
      if (j == 0 || pairs[j].first != pairs[j - 1].first) {
        rows_.push_back(pairs[j].first);
        offsets_.push_back(static_cast<int64_t>(j));
      }
      sources_[j] = pairs[j].second;
    }
    offsets_.push_back(kept);
  } else {
    // Pass 2: prefix sum over touched rows; counts_ becomes each row's write cursor.
    int64_t pos = 0;
    for (int64_t r = 0; r < num_rows; ++r) {
      const int64_t c = counts_[static_cast<size_t>(r)];
      if (c == 0) continue;
      rows_.push_back(r);
      offsets_.push_back(pos);
      counts_[static_cast<size_t>(r)] = pos;
      pos += c;
    }
    offsets_.push_back(pos);
    // Pass 3: stable placement in source order.
    for (int64_t i = 0; i < k; ++i) {
      const int64_t v = at(i);
      if (ignore_index && v == *ignore_index) continue;
      sources_[static_cast<size_t>(counts_[static_cast<size_t>(v)]++)] = i;
    }
  }
  num_rows_ = num_rows;
  num_entries_ = k;
  ignore_index_ = ignore_index;
}

}  // namespace scatter_add
