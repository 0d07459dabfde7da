// The kernel table for the ISA level in use (see dispatch.cpp).
#pragma once

#include "kernels.h"

namespace scatter_add {
namespace cpu {
const KernelTable& active_kernels();
}  // namespace cpu
}  // namespace scatter_add
