// swaserve inspector, the chat's messages: a user turn with attached images becomes OpenAI content parts
// (`image_url` parts with data: URLs, then the text); the whole conversation is sent on every turn, so a
// later turn resends the earlier turns' images (and the prefix cache reuses their KV).
// Plain JavaScript with no DOM use outside readDataUrl: tests run these functions under node.
"use strict";

// the user message of one turn: the text alone, or the images (in attachment order) then the text
function userMessage(text, imageUrls) {
  if (!imageUrls || imageUrls.length === 0) return { role: "user", content: text };
  const content = imageUrls.map((url) => ({ type: "image_url", image_url: { url } }));
  if (text) content.push({ type: "text", text });
  return { role: "user", content };
}

// the request's messages: the system prompt (when set), then every turn so far, images included
function chatMessages(system, conversation) {
  const messages = [];
  if (system) messages.push({ role: "system", content: system });
  for (const m of conversation) messages.push(m);
  return messages;
}

// the image files of a FileList / DataTransfer list (a paste or drop may carry other things)
function imageFiles(files) {
  return Array.from(files || []).filter((f) => f && typeof f.type === "string" && f.type.startsWith("image/"));
}

// a File as a data: URL (browser only)
function readDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(new Error(`${file.name}: ${reader.error ? reader.error.message : "unreadable"}`));
    reader.readAsDataURL(file);
  });
}

if (typeof module !== "undefined" && module.exports) module.exports = { userMessage, chatMessages, imageFiles };
