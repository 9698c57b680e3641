package scan_test

import (
	"fmt"
	"net/http"

	"github.com/caddy-redis/ratelimit/internal/scan"
)

// An OpenAI chat completion streamed as server-sent events, its usage in
// the last chunk before [DONE]: the caller names the path once, hands
// the scan the response's headers, then each piece of the body as it
// passes (here cut in the middle of the usage), and reads the sum at the
// end. A body without the path gives the reason instead.
func Example() {
	var paths scan.Paths
	total, err := paths.Add("usage.total_tokens")
	if err != nil {
		panic(err)
	}

	var body scan.Body
	body.Reset(&paths, 0) // 0: read the whole body
	body.Begin(http.Header{"Content-Type": {"text/event-stream; charset=utf-8"}})
	for _, piece := range []string{
		"data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}],\"usage\":null}\n\n",
		"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":2,\"tot",
		"al_tokens\":12}}\n\ndata: [DONE]\n\n",
	} {
		_, _ = body.Write([]byte(piece))
	}
	tokens, why := body.Sum(total)
	fmt.Printf("%v tokens %q\n", tokens, why)

	body.Reset(&paths, 0)
	body.Begin(http.Header{"Content-Type": {"application/json"}})
	_, _ = body.Write([]byte(`{"error":{"message":"overloaded"}}`))
	tokens, why = body.Sum(total)
	fmt.Printf("%v tokens %q\n", tokens, why)
	// Output:
	// 12 tokens ""
	// 0 tokens "no number at usage.total_tokens in the body"
}
