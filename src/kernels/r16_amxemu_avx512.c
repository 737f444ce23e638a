/* r16_amxemu_avx512.c: r16_amx.c built with its tile instructions emulated in C (KN_AMX_EMU),
 * AVX-512 for the rest, so that the AMX kernels' logic (tiling, tails, the q4 split, the scale
 * order) is tested bitwise against the VNNI kernel on CPUs without AMX. Symbols end in _emu;
 * only tests call them. */
#define KN_AMX_EMU 1
#include "r16_amx.c"
