// How a plan's rows are shared between threads: equal shares of cost, where plan row r costs
// (its contributions + row_cost) row-transfers and split points inside a row fall on
// CpuPolicy::kColumnAlign columns (a hot row spreads over threads by columns). Each share is a
// partial first row, whole rows, and a partial last row; f(r0, r1, c0, c1) is called per run of
// rows with the same column range, so a kernel can walk many short rows in one call.
#pragma once

#include <cstdint>
#include <vector>

#include "policy.h"

namespace scatter_add {
namespace cpu {

class Splitter {
 public:
  Splitter(const std::vector<int64_t>& offsets, int64_t rows, int64_t cols, int64_t row_cost)
      : off_(offsets), r_(rows), cols_(cols), row_cost_(row_cost) {}
  int64_t total() const { return prefix(r_); }

  template <class F>
  void for_share(int t, int n, F&& f) const {
    const int64_t tot = total();
    const Pos b = locate(static_cast<int64_t>(static_cast<unsigned __int128>(tot) * t / n));
    const Pos e = locate(static_cast<int64_t>(static_cast<unsigned __int128>(tot) * (t + 1) / n));
    if (b.row == e.row) {
      if (b.row < r_ && b.col < e.col) f(b.row, b.row + 1, b.col, e.col);
      return;
    }
    int64_t r = b.row;
    if (b.col > 0) {  // partial first row
      if (b.col < cols_) f(r, r + 1, b.col, cols_);
      ++r;
    }
    if (r < e.row) f(r, e.row, int64_t(0), cols_);
    if (e.row < r_ && e.col > 0) f(e.row, e.row + 1, int64_t(0), e.col);
  }

 private:
  struct Pos {
    int64_t row, col;
  };
  int64_t prefix(int64_t r) const { return off_[static_cast<size_t>(r)] + row_cost_ * r; }
  Pos locate(int64_t p) const {
    if (p >= total()) return {r_, 0};
    int64_t lo = 0, hi = r_;  // invariant: prefix(lo) <= p < prefix(hi)
    while (hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;
      (prefix(mid) <= p ? lo : hi) = mid;
    }
    const unsigned __int128 num = static_cast<unsigned __int128>(p - prefix(lo)) * static_cast<uint64_t>(cols_);
    int64_t col = static_cast<int64_t>(num / static_cast<unsigned __int128>(prefix(lo + 1) - prefix(lo)));
    col -= col % CpuPolicy::kColumnAlign;
    return {lo, col};
  }

  const std::vector<int64_t>& off_;
  int64_t r_, cols_, row_cost_;
};

}  // namespace cpu
}  // namespace scatter_add
