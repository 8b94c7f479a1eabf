/*
 * ktls_probe: prove that the running kernel does TLS record crypto (kTLS),
 * without any TLS library.  Part of the tlsplane VM harness (vm/run).
 *
 * It opens a TCP connection over 127.0.0.1, attaches the "tls" ULP to both
 * ends, installs a fixed dummy TLS 1.3 key as TLS_TX on the client and
 * checks the first record on the wire by reading it raw on the server
 * (record header 17 03 03, length = plaintext + 1 content-type byte + 16-byte
 * tag, body != plaintext).  Then it installs the same key as TLS_RX on the
 * server (record sequence 1), sends a larger multi-record payload and checks
 * the kernel decrypts it intact.
 *
 * Effect on /proc/net/tls_stat per run: TlsTxSw +1, TlsRxSw +1.
 * With --bad-key the RX key differs: recv() must fail with EBADMSG
 * (TlsDecryptError +1).
 *
 * usage: ktls_probe [aes128|aes256|chacha20] [--bad-key]
 * exit: 0 ok, 1 check failed, 2 usage, 3 kTLS unavailable (ULP/cipher).
 */
#include <arpa/inet.h>
#include <errno.h>
#include <linux/tls.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#ifndef SOL_TLS
#define SOL_TLS 282
#endif
#ifndef TCP_ULP
#define TCP_ULP 31
#endif

#define FIRST_LEN 100
#define BULK_LEN (64 * 1024 + 123) /* several 16 KiB records */

static const char *cipher = "aes128";

static int die(int code, const char *what)
{
	fprintf(stderr, "ktls_probe(%s): %s: %s\n", cipher, what, strerror(errno));
	exit(code);
}

/* Build the crypto_info for `cipher`; rec_seq is big-endian. */
static size_t crypto_info(unsigned char *buf, unsigned char keybyte, unsigned seq)
{
	union {
		struct tls12_crypto_info_aes_gcm_128 a128;
		struct tls12_crypto_info_aes_gcm_256 a256;
		struct tls12_crypto_info_chacha20_poly1305 c;
	} u;
	size_t len;
	unsigned char *key, *iv, *salt = NULL, *rec;
	size_t klen, ivlen, saltlen = 0;

	memset(&u, 0, sizeof(u));
	if (!strcmp(cipher, "aes128")) {
		u.a128.info.cipher_type = TLS_CIPHER_AES_GCM_128;
		key = u.a128.key; klen = sizeof(u.a128.key);
		iv = u.a128.iv; ivlen = sizeof(u.a128.iv);
		salt = u.a128.salt; saltlen = sizeof(u.a128.salt);
		rec = u.a128.rec_seq; len = sizeof(u.a128);
	} else if (!strcmp(cipher, "aes256")) {
		u.a256.info.cipher_type = TLS_CIPHER_AES_GCM_256;
		key = u.a256.key; klen = sizeof(u.a256.key);
		iv = u.a256.iv; ivlen = sizeof(u.a256.iv);
		salt = u.a256.salt; saltlen = sizeof(u.a256.salt);
		rec = u.a256.rec_seq; len = sizeof(u.a256);
	} else {
		u.c.info.cipher_type = TLS_CIPHER_CHACHA20_POLY1305;
		key = u.c.key; klen = sizeof(u.c.key);
		iv = u.c.iv; ivlen = sizeof(u.c.iv);
		rec = u.c.rec_seq; len = sizeof(u.c);
	}
	u.a128.info.version = TLS_1_3_VERSION; /* info is first in every variant */
	memset(key, keybyte, klen);
	memset(iv, 0x5a, ivlen);
	if (salt)
		memset(salt, 0xa5, saltlen);
	rec[7] = seq & 0xff;
	rec[6] = (seq >> 8) & 0xff;
	memcpy(buf, &u, len);
	return len;
}

static void set_key(int fd, int dir, unsigned char keybyte, unsigned seq)
{
	unsigned char buf[128];
	size_t len = crypto_info(buf, keybyte, seq);

	if (setsockopt(fd, SOL_TLS, dir, buf, len) < 0)
		die(3, dir == TLS_TX ? "setsockopt(TLS_TX)" : "setsockopt(TLS_RX)");
}

static void read_full(int fd, unsigned char *p, size_t n, const char *what)
{
	while (n > 0) {
		ssize_t r = read(fd, p, n);
		if (r == 0) {
			fprintf(stderr, "ktls_probe(%s): %s: unexpected EOF\n", cipher, what);
			exit(1);
		}
		if (r < 0) {
			if (errno == EINTR)
				continue;
			die(1, what);
		}
		p += r;
		n -= (size_t)r;
	}
}

static void write_full(int fd, const unsigned char *p, size_t n)
{
	while (n > 0) {
		ssize_t r = write(fd, p, n);
		if (r < 0) {
			if (errno == EINTR)
				continue;
			die(1, "write");
		}
		p += r;
		n -= (size_t)r;
	}
}

int main(int argc, char **argv)
{
	int bad_key = 0, lfd, cfd, sfd, one = 1, i;
	struct sockaddr_in sa = { .sin_family = AF_INET };
	socklen_t slen = sizeof(sa);
	static unsigned char msg[BULK_LEN], got[BULK_LEN];
	unsigned char rec[5 + FIRST_LEN + 1 + 16];

	for (i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--bad-key"))
			bad_key = 1;
		else if (!strcmp(argv[i], "aes128") || !strcmp(argv[i], "aes256") ||
			 !strcmp(argv[i], "chacha20"))
			cipher = argv[i];
		else {
			fprintf(stderr, "usage: ktls_probe [aes128|aes256|chacha20] [--bad-key]\n");
			return 2;
		}
	}
	for (i = 0; i < BULK_LEN; i++)
		msg[i] = (unsigned char)('a' + i % 26);

	sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	if ((lfd = socket(AF_INET, SOCK_STREAM, 0)) < 0 ||
	    bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) < 0 || listen(lfd, 1) < 0 ||
	    getsockname(lfd, (struct sockaddr *)&sa, &slen) < 0)
		die(1, "listen on 127.0.0.1");
	if ((cfd = socket(AF_INET, SOCK_STREAM, 0)) < 0 ||
	    connect(cfd, (struct sockaddr *)&sa, sizeof(sa)) < 0)
		die(1, "connect");
	if ((sfd = accept(lfd, NULL, NULL)) < 0)
		die(1, "accept");
	setsockopt(cfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));

	if (setsockopt(cfd, IPPROTO_TCP, TCP_ULP, "tls", sizeof("tls")) < 0 ||
	    setsockopt(sfd, IPPROTO_TCP, TCP_ULP, "tls", sizeof("tls")) < 0)
		die(3, "setsockopt(TCP_ULP, \"tls\")");
	set_key(cfd, TLS_TX, 0x11, 0);

	/* Record 0: read it raw, it must be a sealed TLS 1.3 record. */
	write_full(cfd, msg, FIRST_LEN);
	read_full(sfd, rec, sizeof(rec), "read raw record");
	if (rec[0] != 0x17 || rec[1] != 3 || rec[2] != 3 ||
	    ((rec[3] << 8) | rec[4]) != FIRST_LEN + 1 + 16) {
		fprintf(stderr, "ktls_probe(%s): bad record header %02x %02x %02x %02x %02x\n",
			cipher, rec[0], rec[1], rec[2], rec[3], rec[4]);
		return 1;
	}
	if (!memcmp(rec + 5, msg, FIRST_LEN)) {
		fprintf(stderr, "ktls_probe(%s): record body is plaintext\n", cipher);
		return 1;
	}

	/* Records 1..n: the kernel decrypts them on the server side. */
	set_key(sfd, TLS_RX, bad_key ? 0x22 : 0x11, 1);
	write_full(cfd, msg, BULK_LEN);
	if (bad_key) {
		ssize_t r = read(sfd, got, sizeof(got));
		if (r < 0 && errno == EBADMSG) {
			printf("ktls_probe(%s): wrong RX key rejected with EBADMSG: ok\n", cipher);
			return 0;
		}
		fprintf(stderr, "ktls_probe(%s): wrong key: read=%zd errno=%d, want EBADMSG\n",
			cipher, r, r < 0 ? errno : 0);
		return 1;
	}
	read_full(sfd, got, BULK_LEN, "read via kTLS RX");
	if (memcmp(got, msg, BULK_LEN)) {
		fprintf(stderr, "ktls_probe(%s): decrypted data differs\n", cipher);
		return 1;
	}
	printf("ktls_probe(%s): TX record sealed on the wire, %d bytes decrypted by TLS_RX: ok\n",
	       cipher, BULK_LEN);
	close(cfd);
	close(sfd);
	close(lfd);
	return 0;
}
