// host stand-in for <cooperative_groups.h>: MLX's generated source includes it and aliases the namespace;
// nothing of it is modelled, so a kernel that uses it fails to compile here rather than run wrongly
#pragma once
namespace cooperative_groups {}
