/* A float32 as orjson writes a numpy float32 in JSON (_jsonrows.c's float_lists): the shortest
   decimal that reads back as the same float32 (of those, the closest; an exact tie to the even
   last digit), laid out as Rust's ryu lays it out, with orjson's `+` on a positive exponent:
   digits d1..dn times 10^e, kk = n + e, written
     d1..dn 0...0 ".0"        where e >= 0 and kk <= 13     (123456790.0, 1000000000000.0)
     d1..dkk "." ...dn        where e < 0 and 0 < kk <= 13  (12.34)
     "0." 0...0 d1..dn        where -6 < kk <= 0            (0.000001, 0.00012345)
     d1 ["." d2..dn] "e" sign (kk - 1)  otherwise            (1e-7, 1.5e+13, 3.4028235e+38)
   0.0 and -0.0 as "0.0" and "-0.0"; NaN and the infinities as "null". At most F32_TEXT_MOST bytes.

   The shortest decimal in exact integer arithmetic: the rounding interval's bounds and twice the
   value, scaled to 10^e10 (e10 = floor(log10 2^e2): the interval spans 3 to 40 units, each number
   below 2^31), are floored exactly (a 64 x 128-bit product with 5^-e10, or a 128-bit division by
   5^e10); digits are dropped while the interval holds a multiple of the next power of ten, then the
   value is rounded to the last digit kept (an exact tie to even), up where its floor lies below the
   interval. The digits are laid out in registers and written with fixed-size stores (no branch on
   their count). Also the decimal digits the integer writers share (DIGIT_PAIRS, digits_of,
   digits_at, eight_digits). Plain C (no Python.h): a test harness can build it alone. */
#ifndef F32JSON_H
#define F32JSON_H

#include <stdint.h>
#include <string.h>

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "_f32json.h: a little-endian host"
#endif

#define F32_TEXT_MOST 17 /* -0.00000123456789: a sign, "0.", five zeros, nine digits */
#define F32_TEXT_ROOM 32 /* what f32_text may write past w */

static const char DIGIT_PAIRS[] = "00010203040506070809101112131415161718192021222324252627282930313233343536373839"
                                  "40414243444546474849505152535455565758596061626364656667686970717273747576777879"
                                  "8081828384858687888990919293949596979899";

static const uint64_t POWERS_OF_TEN[20] = {1ULL, 10ULL, 100ULL, 1000ULL, 10000ULL, 100000ULL, 1000000ULL,
    10000000ULL, 100000000ULL, 1000000000ULL, 10000000000ULL, 100000000000ULL, 1000000000000ULL,
    10000000000000ULL, 100000000000000ULL, 1000000000000000ULL, 10000000000000000ULL,
    100000000000000000ULL, 1000000000000000000ULL, 10000000000000000000ULL};

/* the count of v's decimal digits, from its bit length without a branch: bits 1233 / 4096 is
   floor(log10 2^bits), and v has that many digits or one more */
static inline int digits_of(uint64_t v) {
    v |= 1; /* 0 has a digit; no power of ten is odd */
    int guess = ((64 - __builtin_clzll(v)) * 1233) >> 12;
    return guess + (v >= POWERS_OF_TEN[guess]);
}

/* v's decimal digits, the last at end[-1] */
static inline void digits_at(char *end, uint64_t v) {
    while (v >= 100) {
        end -= 2;
        memcpy(end, DIGIT_PAIRS + 2 * (v % 100), 2);
        v /= 100;
    }
    if (v >= 10) memcpy(end - 2, DIGIT_PAIRS + 2 * v, 2);
    else end[-1] = (char)('0' + v);
}

#define ZEROS_8 0x3030303030303030ULL /* "00000000" */

/* The 8 digits of x < 10^8, zero-padded, the first in the lowest byte: two 4-digit halves in 32-bit
   lanes split into pairs (x 10486 / 2^20 is x / 100 below 10^4), the pairs in 16-bit lanes into
   digits (x 103 / 2^10 is x / 10 below 100), no lane overflowing into the next */
static inline uint64_t eight_digits(uint32_t x) {
    uint64_t v = (uint64_t)(x / 10000) | (uint64_t)(x % 10000) << 32;
    uint64_t q = ((v * 10486) >> 20) & 0x0000007F0000007FULL;
    v = q | (v - q * 100) << 16;
    q = ((v * 103) >> 10) & 0x000F000F000F000FULL;
    return (q | (v - q * 10) << 8) | ZEROS_8;
}

/* 5^i for i in 0 .. 46, 128 bits each (f32_tables) */
static uint64_t F32_POW5_HI[47], F32_POW5_LO[47];

static void f32_tables(void) {
    __uint128_t p = 1;
    for (int i = 0; i < 47; i++, p *= 5) {
        F32_POW5_HI[i] = (uint64_t)(p >> 64);
        F32_POW5_LO[i] = (uint64_t)p;
    }
}

/* floor(x / 2^shift) (shift < 64, the floor below 2^32; below: 2^shift - 1), and whether it is exact */
static inline uint32_t f32_floor(__uint128_t x, int shift, uint64_t below, int *exact) {
    uint64_t low = (uint64_t)x, high = (uint64_t)(x >> 64);
    *exact = (low & below) == 0;
    return (uint32_t)((low >> shift) | (high << 1) << (63 - shift));
}

/* floor(m 5^f / 2^shift) (m < 2^28, f <= 46, shift < 128), and whether it is exact */
static inline uint32_t f32_scale_down(uint64_t m, int f, int shift, int *exact) { /* m < 2^28 */
    __uint128_t low = (__uint128_t)m * F32_POW5_LO[f];
    __uint128_t high = (__uint128_t)m * F32_POW5_HI[f] + (low >> 64); /* the product: high 2^64 + low64 */
    uint64_t low64 = (uint64_t)low;
    if (shift == 0) {
        *exact = 1;
        return (uint32_t)low64;
    }
    if (shift < 64) {
        *exact = (low64 << (64 - shift)) == 0;
        return (uint32_t)((high << (64 - shift)) | (low64 >> shift));
    }
    int s = shift - 64;
    *exact = low64 == 0 && (s == 0 || (high & (((__uint128_t)1 << s) - 1)) == 0);
    return (uint32_t)(high >> s);
}

/* floor(m 2^up / 5^e10) (m 2^up < 2^100, e10 <= 31), and whether it is exact */
static inline uint32_t f32_divide(uint64_t m, int up, int e10, int *exact) {
    __uint128_t n = (__uint128_t)m << up;
    if (e10 == 0) {
        *exact = 1;
        return (uint32_t)n;
    }
    __uint128_t d = ((__uint128_t)F32_POW5_HI[e10] << 64) | F32_POW5_LO[e10];
    __uint128_t q = n / d;
    *exact = q * d == n;
    return (uint32_t)q;
}

/* the shortest decimal of a finite, non-zero float32 (its sign ignored): digits 10^exponent */
typedef struct {
    uint32_t digits;
    int exponent;
} F32Decimal;

static inline F32Decimal f32_shortest(uint32_t bits) {
    uint32_t fraction = bits & 0x7FFFFFu, biased = (bits >> 23) & 0xFFu;
    uint32_t c = biased ? fraction | 0x800000u : fraction;
    int e2 = (biased ? (int)biased - 150 : -149) - 2; /* v = 4c 2^e2 */
    int closed = (c & 1) == 0;                        /* round to even reads the bounds back as v */
    uint64_t mv = 4 * (uint64_t)c, mp = mv + 2, mm = mv - ((fraction == 0 && biased > 1) ? 1 : 2);
    int e10 = (e2 * 78913) >> 18; /* floor(e2 log10 2), e2 in -151 .. 102 */
    uint32_t vm, vr, vp;
    int m_exact, r_exact, p_exact;
    if (e10 >= 0) {
        vm = f32_divide(mm, e2 - e10, e10, &m_exact);
        vr = f32_divide(2 * mv, e2 - e10, e10, &r_exact);
        vp = f32_divide(mp, e2 - e10, e10, &p_exact);
    } else if (e10 >= -27) { /* 5^-e10 below 2^63, shift below 64: one 64 x 64-bit product each */
        int shift = e10 - e2;  /* 2^e2 10^-e10 = 5^-e10 / 2^shift */
        uint64_t five = F32_POW5_LO[-e10], below = (UINT64_C(1) << shift) - 1;
        vm = f32_floor((__uint128_t)mm * five, shift, below, &m_exact);
        vr = f32_floor((__uint128_t)(2 * mv) * five, shift, below, &r_exact);
        vp = f32_floor((__uint128_t)mp * five, shift, below, &p_exact);
    } else {
        int shift = e10 - e2;
        vm = f32_scale_down(mm, -e10, shift, &m_exact);
        vr = f32_scale_down(2 * mv, -e10, shift, &r_exact);
        vp = f32_scale_down(mp, -e10, shift, &p_exact);
    }
    /* candidates: integers in [lower, upper] (closed) or (lower, upper), in units of 10^e10 */
    if (p_exact && !closed) vp--;
    int low_in = closed && m_exact; /* the lower bound itself is a candidate, and so far a multiple */
    /* vr is 2v so far: its half as the digit `last` dropped from v (5 from a half up, else 0), and
       r_zeros: what lies below `last` is 0 */
    uint32_t last = (vr & 1) ? 5 : 0;
    int r_zeros = r_exact;
    vr >>= 1;
    int removed = 0;
    /* drop a digit while a multiple of 10 lies above the lower bound, or is the lower bound itself
       (a candidate) */
    while (vp / 10 > vm / 10 || (low_in && vm % 10 == 0)) {
        low_in &= vm % 10 == 0;
        r_zeros &= last == 0;
        last = vr % 10;
        vr /= 10;
        vp /= 10;
        vm /= 10;
        removed++;
    }
    if (r_zeros && last == 5 && vr % 2 == 0) last = 4; /* an exact tie: the even one */
    F32Decimal d = {vr + ((vr == vm && !low_in) || last >= 5), e10 + removed};
    return d;
}

#define POINT_ZEROS 0x30303030302E30ULL /* "0.00000" */

/* The digits of v < 10^9 as the string P = first, eight[0..8) (zero-padded to nine), its n
   significant ones P[9 - n .. 9); held in registers and written with fixed-size stores, never read
   back (a wide load of narrow stores stalls) */
typedef struct {
    uint64_t eight;
    char first;
    int n;
} Digits;

static inline Digits digits_of_f32(uint32_t v) {
    Digits d = {eight_digits(v % 100000000), (char)('0' + v / 100000000), digits_of(v)};
    return d;
}

/* P[9 - n + k .. 9 - n + k + 8), k < n (bytes past P's end: 0) */
static inline uint64_t digits_from(const Digits *d, int k) {
    int at = 9 - d->n + k; /* 0 .. 8 */
    return at ? d->eight >> (8 * (at - 1)) : (uint64_t)(unsigned char)d->first | d->eight << 8;
}

/* the n digits at w, up to 9 bytes written */
static inline void put_digits(char *w, const Digits *d) {
    w[0] = d->first;
    uint64_t rest = digits_from(d, d->n == 9);
    memcpy(w + (d->n == 9), &rest, 8);
}

/* the digits with a point after the first k (0 < k < n) at w, up to 16 bytes written */
static inline void put_point(char *w, const Digits *d, int k) {
    uint64_t head = digits_from(d, 0), tail = digits_from(d, k);
    memcpy(w, &head, 8);
    w[k] = '.';
    memcpy(w + k + 1, &tail, 8);
}

/* The float32 of these bits as orjson's JSON text at w: the byte after it. The text is at most
   F32_TEXT_MOST bytes, but up to F32_TEXT_ROOM bytes from w may be written. */
static inline char *f32_text(char *w, uint32_t bits) {
    if ((bits & 0x7F800000u) == 0x7F800000u) {
        memcpy(w, "null", 4);
        return w + 4;
    }
    if (bits >> 31) *w++ = '-';
    if ((bits & 0x7FFFFFFFu) == 0) {
        memcpy(w, "0.0", 3);
        return w + 3;
    }
    F32Decimal dec = f32_shortest(bits);
    Digits d = digits_of_f32(dec.digits);
    int n = d.n, kk = n + dec.exponent;
    if (dec.exponent >= 0 && kk <= 13) { /* 1234e7 -> 12340000000.0 */
        uint64_t zeros = ZEROS_8;
        put_digits(w, &d);
        memcpy(w + n, &zeros, 8);
        memcpy(w + n + 8, &zeros, 8);
        memcpy(w + kk, ".0", 2);
        return w + kk + 2;
    }
    if (kk > 0 && kk <= 13) { /* 1234e-2 -> 12.34 (kk < n) */
        put_point(w, &d, kk);
        return w + n + 1;
    }
    if (kk > -6 && kk <= 0) { /* 1234e-6 -> 0.001234 */
        uint64_t prefix = POINT_ZEROS;
        memcpy(w, &prefix, 8);
        put_digits(w + 2 - kk, &d);
        return w + 2 - kk + n;
    }
    if (n > 1) { /* 1234e30 -> 1.234e+33 */
        put_point(w, &d, 1);
        w += n + 1;
    } else { /* 1e30 */
        *w++ = (char)('0' + dec.digits);
    }
    int x = kk - 1;
    *w++ = 'e';
    *w++ = x < 0 ? '-' : '+';
    if (x < 0) x = -x;
    if (x >= 10) {
        memcpy(w, DIGIT_PAIRS + 2 * x, 2);
        return w + 2;
    }
    *w = (char)('0' + x);
    return w + 1;
}

#endif
